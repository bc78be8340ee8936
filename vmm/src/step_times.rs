//! Where a long operation's time went, step by step, for its log line:
//! a migration's downtime or a restore is judged by the guest's wait,
//! and an operator who finds it long needs to see which step took it.

use std::fmt;
use std::time::{Duration, Instant};

/// Steps and how long each took, in the order they ran.
pub struct StepTimes {
    started: Instant,
    last: Instant,
    steps: Vec<(&'static str, Duration)>,
}

impl StepTimes {
    pub fn start() -> Self {
        let now = Instant::now();
        StepTimes {
            started: now,
            last: now,
            steps: Vec::new(),
        }
    }

    /// Ends the step `name`: the time since the previous step ended.
    pub fn step(&mut self, name: &'static str) {
        let now = Instant::now();
        self.steps.push((name, now.duration_since(self.last)));
        self.last = now;
    }

    /// From the start to the end of the last step.
    pub fn total(&self) -> Duration {
        self.last.duration_since(self.started)
    }
}

impl fmt::Display for StepTimes {
    /// `12.3 ms (pause 0.4, save 8.1, send 3.8)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        write!(f, "{:.1} ms (", ms(self.total()))?;
        for (i, (name, took)) in self.steps.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{name} {:.1}", ms(*took))?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steps_add_up_to_the_total_and_print_in_order() {
        let mut t = StepTimes::start();
        std::thread::sleep(Duration::from_millis(2));
        t.step("first");
        t.step("second");
        let sum: Duration = t.steps.iter().map(|(_, d)| *d).sum();
        assert_eq!(sum, t.total());
        assert!(t.steps[0].1 >= Duration::from_millis(2));
        let line = t.to_string();
        let first = line.find("first ").unwrap();
        let second = line.find(", second ").unwrap();
        assert!(first < second, "{line}");
        assert!(line.ends_with(')'), "{line}");
    }
}
