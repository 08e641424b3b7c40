//! A budget for a reply's reasoning (Anthropic's `thinking.budget_tokens`): once the model has
//! reasoned for that many tokens, the tokens that close its reasoning are the next it takes,
//! whatever it would have picked, and the answer follows.

/// One generation's reasoning budget and how much of it is spent.
#[derive(Debug, Clone)]
pub struct ReasoningBudget {
    /// The tokens that open and close a reasoning block (each marker as the tokenizer encodes
    /// it: one token for the reasoning models' own markers).
    open: Vec<u32>,
    close: Vec<u32>,
    /// Reasoning tokens allowed, and those taken so far (markers aside).
    budget: usize,
    spent: usize,
    state: State,
}

/// Where the reply stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Answering,
    Reasoning,
    /// The budget is spent: this many of the close marker's tokens have been forced.
    Closing(usize),
}

impl ReasoningBudget {
    /// A budget of `budget` tokens for reasoning between `open` and `close`; `in_reasoning`
    /// when the prompt opened the block the reply continues.
    pub fn new(open: Vec<u32>, close: Vec<u32>, budget: usize, in_reasoning: bool) -> Self {
        ReasoningBudget {
            open,
            close,
            budget,
            spent: 0,
            state: match in_reasoning {
                true => State::Reasoning,
                false => State::Answering,
            },
        }
    }

    /// The token the next step must take, where the budget forces one.
    pub fn forced(&self) -> Option<u32> {
        match self.state {
            State::Closing(done) => self.close.get(done).copied(),
            State::Reasoning if self.spent >= self.budget => self.close.first().copied(),
            State::Reasoning | State::Answering => None,
        }
    }

    /// Counts the token just taken, `taken` ending with it.
    pub fn took(&mut self, taken: &[u32]) {
        // The close marker's tokens forced so far, the one just taken among them.
        let closed = |done: usize| match done < self.close.len() {
            true => State::Closing(done),
            false => State::Answering,
        };
        self.state = match self.state {
            State::Closing(done) => closed(done + 1),
            // The first of the close marker's tokens went in place of the model's.
            State::Reasoning if self.spent >= self.budget => closed(1),
            State::Reasoning if ends_with(taken, &self.close) => State::Answering,
            State::Reasoning => {
                self.spent += 1;
                State::Reasoning
            }
            State::Answering if ends_with(taken, &self.open) => State::Reasoning,
            State::Answering => State::Answering,
        };
    }
}

fn ends_with(taken: &[u32], marker: &[u32]) -> bool {
    !marker.is_empty() && taken.ends_with(marker)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `picks` (what the model would take) through `budget`: what is taken.
    fn run(mut budget: ReasoningBudget, picks: &[u32]) -> Vec<u32> {
        let mut taken = Vec::new();
        for &pick in picks {
            taken.push(budget.forced().unwrap_or(pick));
            budget.took(&taken);
        }
        taken
    }

    #[test]
    fn reasoning_past_its_budget_is_closed() {
        // Open 1, close 2; reasoning tokens 5, answer 7.
        let budget = |in_reasoning| ReasoningBudget::new(vec![1], vec![2], 3, in_reasoning);
        assert_eq!(run(budget(true), &[5, 5, 5, 5, 5, 7]), [5, 5, 5, 2, 5, 7]);
        assert_eq!(run(budget(true), &[5, 2, 7, 7, 7, 7]), [5, 2, 7, 7, 7, 7]);
        assert_eq!(
            run(budget(false), &[7, 1, 5, 5, 5, 5, 7]),
            [7, 1, 5, 5, 5, 2, 7]
        );
        // An answer without reasoning is left alone.
        assert_eq!(run(budget(false), &[7, 7, 7, 7, 7]), [7, 7, 7, 7, 7]);
        // The budget spans the reply's reasoning blocks.
        assert_eq!(
            run(budget(false), &[1, 5, 5, 2, 1, 5, 5]),
            [1, 5, 5, 2, 1, 5, 2]
        );
        // No reasoning at all.
        let none = ReasoningBudget::new(vec![1], vec![2], 0, true);
        assert_eq!(run(none, &[5, 7]), [2, 7]);
    }

    #[test]
    fn markers_of_several_tokens() {
        let budget = ReasoningBudget::new(vec![1, 8], vec![2, 9], 2, false);
        assert_eq!(
            run(budget.clone(), &[1, 8, 5, 5, 5, 5, 7]),
            [1, 8, 5, 5, 2, 9, 7]
        );
        assert_eq!(run(budget, &[1, 8, 2, 9, 5, 5, 5]), [1, 8, 2, 9, 5, 5, 5]);
    }
}
