//! Counting outcomes by kind, and keeping the failures to show.

use std::collections::BTreeMap;

/// How many failures are printed in full; the rest are only counted.
const SHOWN_FAILURES: usize = 40;

/// Counts of outcomes per kind of case, printed as a table.
#[derive(Default)]
pub struct Tally {
    counts: BTreeMap<String, BTreeMap<String, u64>>,
    failures: Vec<String>,
    failure_count: usize,
}

impl Tally {
    pub fn count(&mut self, kind: &str, outcome: &str) {
        *self
            .counts
            .entry(kind.to_owned())
            .or_default()
            .entry(outcome.to_owned())
            .or_default() += 1;
    }

    /// Counts a failure and keeps its description (how to reproduce it included).
    pub fn fail(&mut self, kind: &str, outcome: &str, description: String) {
        self.count(kind, outcome);
        self.failure_count += 1;
        if self.failures.len() < SHOWN_FAILURES {
            self.failures.push(description);
        }
    }

    pub fn failures(&self) -> usize {
        self.failure_count
    }

    /// The total of a kind over every outcome.
    pub fn kind_total(&self, kind: &str) -> u64 {
        self.counts.get(kind).map_or(0, |row| row.values().sum())
    }

    /// The total of an outcome over every kind.
    pub fn total(&self, outcome: &str) -> u64 {
        self.counts
            .values()
            .filter_map(|row| row.get(outcome))
            .sum()
    }

    /// The table (kinds down, outcomes across), then the failures kept.
    pub fn print(&self) {
        let mut outcomes: Vec<&String> = self.counts.values().flat_map(|row| row.keys()).collect();
        outcomes.sort();
        outcomes.dedup();
        let width = self
            .counts
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(4)
            .max(4);
        print!("{:width$}", "kind");
        for outcome in &outcomes {
            print!("  {outcome:>w$}", w = outcome.len().max(5));
        }
        println!();
        for (kind, row) in &self.counts {
            print!("{kind:width$}");
            for outcome in &outcomes {
                let count = row.get(*outcome).copied().unwrap_or(0);
                print!("  {count:>w$}", w = outcome.len().max(5));
            }
            println!();
        }
        if self.failure_count > 0 {
            println!("\n{} failures:", self.failure_count);
            for failure in &self.failures {
                println!("- {failure}");
            }
            if self.failure_count > self.failures.len() {
                println!("- … and {} more", self.failure_count - self.failures.len());
            }
        }
    }
}
