//! Stop strings matched on decoded text, as the OpenAI API defines them: generation ends at the
//! first occurrence of any of them, and neither the stop string nor anything after it is output.
//!
//! Text is released as soon as it can no longer be the start of a stop string, so a stream never
//! shows part of a stop string that a later token completes. (mlx-lm matches stop words on token
//! ids instead, which misses a stop string that the model spells with other tokens.)

/// Holds back text that may begin a stop string; see the module docs.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released: a possible start of a stop string.
    pending: String,
    stopped: bool,
}

/// What one piece of text gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text that is final output.
    pub text: String,
    /// A stop string was found: generation should end, and `text` ends right before it.
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match before any output).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Adds decoded text; returns what can be output now. After a stop, everything is dropped.
    pub fn push(&mut self, text: &str) -> Released {
        if self.stopped {
            return Released {
                text: String::new(),
                stopped: true,
            };
        }
        self.pending.push_str(text);
        let first_match = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first_match {
            self.stopped = true;
            let mut out = std::mem::take(&mut self.pending);
            out.truncate(at);
            return Released {
                text: out,
                stopped: true,
            };
        }
        let keep = self.partial_match_len();
        let out = self.pending[..self.pending.len() - keep].to_owned();
        self.pending.drain(..self.pending.len() - keep);
        Released {
            text: out,
            stopped: false,
        }
    }

    /// Whether a stop string was found.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Releases what was held back (generation ended without completing a stop string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Bytes at the end of `pending` that are the start of some stop string.
    fn partial_match_len(&self) -> usize {
        let p = &self.pending;
        self.stops
            .iter()
            .map(|stop| {
                // The longest proper prefix of `stop` that `p` ends with.
                (1..stop.len().min(p.len() + 1))
                    .rev()
                    .filter(|&n| stop.is_char_boundary(n))
                    .find(|&n| p.ends_with(&stop[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = Vec::new();
        let mut stopped = false;
        for p in pieces {
            let r = m.push(p);
            out.push(r.text);
            if r.stopped {
                stopped = true;
                break;
            }
        }
        let rest = m.finish();
        (out, stopped, rest)
    }

    #[test]
    fn stop_across_pieces_is_never_released() {
        let (out, stopped, _) = run(&["END"], &["abc E", "N", "D tail"]);
        assert_eq!(out, ["abc ", "", ""]);
        assert!(stopped);
    }

    #[test]
    fn partial_that_diverges_is_released() {
        let (out, stopped, rest) = run(&["END"], &["xE", "Nx", "E"]);
        assert_eq!(out, ["x", "ENx", ""]);
        assert!(!stopped);
        assert_eq!(rest, "E");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (out, stopped, _) = run(&["world", "lo w"], &["hello world"]);
        assert_eq!(out, ["hel"]);
        assert!(stopped);
    }

    #[test]
    fn multibyte_prefixes_are_char_aligned() {
        let (out, stopped, rest) = run(&["é!"], &["café", " ok"]);
        assert_eq!(out, ["caf", "é ok"]);
        assert!(!stopped);
        assert_eq!(rest, "");
    }

    #[test]
    fn no_stops_passes_text_through() {
        let (out, stopped, rest) = run(&[""], &["a", "b"]);
        assert_eq!(out, ["a", "b"]);
        assert!(!stopped);
        assert_eq!(rest, "");
    }
}
