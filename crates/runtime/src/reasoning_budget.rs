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
    reasoning: bool,
    /// How many of the close marker's tokens have been forced, while they are being.
    closing: Option<usize>,
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
            reasoning: in_reasoning,
            closing: None,
        }
    }

    /// The token the next step must take, where the budget forces one.
    pub fn forced(&self) -> Option<u32> {
        match self.closing {
            Some(done) => self.close.get(done).copied(),
            None if self.reasoning && self.spent >= self.budget => self.close.first().copied(),
            None => None,
        }
    }

    /// Counts the token just taken, `taken` ending with it.
    pub fn took(&mut self, taken: &[u32]) {
        if let Some(done) = self.closing {
            let done = done + 1;
            if done < self.close.len() {
                self.closing = Some(done);
            } else {
                self.closing = None;
                self.reasoning = false;
            }
        } else if self.reasoning && self.spent >= self.budget {
            // The first of the close marker's tokens went in place of the model's.
            self.closing = Some(0);
            self.took(taken);
        } else if self.reasoning {
            if ends_with(taken, &self.close) {
                self.reasoning = false;
            } else {
                self.spent += 1;
            }
        } else if ends_with(taken, &self.open) {
            self.reasoning = true;
        }
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
