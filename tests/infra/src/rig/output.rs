//! A run's output: stdout and stderr read line by line with arrival times,
//! lines of two writers cut apart at each marker, and the probe that looks
//! into an emulated host gone silent.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::Line;
use crate::monitor::{self, Monitor};

/// How a nested run that has gone silent is looked into.
pub(super) struct StallProbe {
    pub(super) monitor: PathBuf,
    pub(super) silence: Duration,
}

/// What the probe does to a silent emulated host, one stage per
/// [`STAGE_GAP`] of further silence: first a key press (an interrupt
/// through the emulated IOAPIC, which makes QEMU re-evaluate the CPU's
/// pending interrupts), then an NMI (which reaches a CPU whatever its
/// interrupt flag).
pub(super) const KICKS: [(&str, &str); 2] = [("key", "sendkey shift"), ("nmi", "nmi")];

pub(super) const STAGE_GAP: Duration = Duration::from_secs(30);

impl StallProbe {
    /// Records the emulated CPU's state, then kicks it with `KICKS[stage]`.
    fn probe(&self, stage: usize, silence: Duration) -> Vec<String> {
        let (kick, command) = KICKS[stage];
        let mut out = vec![format!(
            "@@RIG stall_probe silence={:.0}s stage={stage}",
            silence.as_secs_f64()
        )];
        match Monitor::connect(&self.monitor) {
            Ok(mut m) => {
                out.extend(monitor::dump(&mut m));
                match m.command(command) {
                    Ok(_) => out.push(format!("@@RIG stall_probe kick={kick}")),
                    Err(e) => out.push(format!("@@RIG stall_probe kick={kick} failed: {e}")),
                }
            }
            Err(e) => out.push(format!(
                "@@RIG stall_probe monitor {}: {e}",
                self.monitor.display()
            )),
        }
        out
    }
}

/// Reads stdout and stderr line by line with arrival times; kills the child
/// at the deadline. A nested run silent for its probe's time is probed, and
/// kicked harder at each further [`STAGE_GAP`] of silence.
pub(super) fn collect_output(
    child: &mut Child,
    start: Instant,
    timeout: Duration,
    stall_probe: Option<&StallProbe>,
) -> (Vec<Line>, bool) {
    let (tx, rx) = mpsc::channel::<Line>();
    let readers: Vec<Box<dyn Read + Send>> = vec![
        Box::new(child.stdout.take().expect("stdout is piped")),
        Box::new(child.stderr.take().expect("stderr is piped")),
    ];
    for reader in readers {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(reader);
            let mut buf = Vec::new();
            while matches!(reader.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
                let text = String::from_utf8_lossy(&buf)
                    .trim_end_matches(['\r', '\n'])
                    .replace('\r', "");
                let at = start.elapsed();
                let sent = split_markers(&text).into_iter().all(|text| {
                    tx.send(Line {
                        at,
                        text: text.to_string(),
                    })
                    .is_ok()
                });
                if !sent {
                    break;
                }
                buf.clear();
            }
        });
    }
    drop(tx);
    let deadline = start + timeout;
    let echo = std::env::var_os("DAX_VMM_RIG_ECHO").is_some();
    let mut lines = Vec::new();
    let mut timed_out = false;
    let mut last_line = Instant::now();
    // Probe stages done since the last line; which kick the output resumed after.
    let mut stages = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(probe) = stall_probe {
            let due = probe.silence + STAGE_GAP * u32::try_from(stages).unwrap_or(u32::MAX);
            if stages < KICKS.len() && last_line.elapsed() >= due {
                for text in probe.probe(stages, last_line.elapsed()) {
                    let line = Line {
                        at: start.elapsed(),
                        text,
                    };
                    eprintln!("[{:7.3}] {}", line.at.as_secs_f64(), line.text);
                    lines.push(line);
                }
                stages += 1;
            }
        }
        match rx.recv_timeout(left.min(Duration::from_millis(200))) {
            Ok(line) => {
                if echo {
                    eprintln!("[{:7.3}] {}", line.at.as_secs_f64(), line.text);
                }
                if stages > 0 {
                    let resumed =
                        format!("@@RIG stall_probe resumed_after={}", KICKS[stages - 1].0);
                    eprintln!("[{:7.3}] {resumed}", line.at.as_secs_f64());
                    lines.push(Line {
                        at: line.at,
                        text: resumed,
                    });
                    stages = 0;
                }
                last_line = Instant::now();
                lines.push(line);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() >= deadline => {
                timed_out = true;
                let _ = child.kill();
                break;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
    let _ = child.wait();
    // Lines that arrived between the kill and the pipes closing.
    lines.extend(rx.try_iter());
    lines.sort_by_key(|l| l.at);
    (lines, timed_out)
}

/// The markers scripts print at the start of their lines.
pub(super) const MARKERS: [&str; 4] = ["@@GUEST ", "@@HOST ", "@@RIG ", "@@DIAG "];

/// One console line as the lines its writers meant. The guest (through the
/// VMM) and the emulated host's scripts share one console, and a line of one
/// can land in the middle of another's, as in `@@GUEST gone=fs:gone@@HOST
/// daemon_after_remove=exited`; a marker never starts inside a line on
/// purpose, so the text is cut before each one.
pub(super) fn split_markers(text: &str) -> Vec<&str> {
    let mut cuts: Vec<usize> = MARKERS
        .iter()
        .flat_map(|m| text.match_indices(m).map(|(i, _)| i))
        .filter(|&i| i > 0)
        .collect();
    cuts.sort_unstable();
    let mut parts = Vec::with_capacity(cuts.len() + 1);
    let mut from = 0;
    for cut in cuts {
        parts.push(&text[from..cut]);
        from = cut;
    }
    parts.push(&text[from..]);
    parts.retain(|p| !p.is_empty());
    if parts.is_empty() {
        parts.push("");
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_of_two_writers_run_together_are_cut_at_each_marker() {
        assert_eq!(
            split_markers("@@GUEST gone=fs:gone blk:gone@@HOST daemon_after_remove=exited"),
            [
                "@@GUEST gone=fs:gone blk:gone",
                "@@HOST daemon_after_remove=exited"
            ]
        );
        assert_eq!(
            split_markers("[ 1.0] kernel text@@RIG vmm_exit=0"),
            ["[ 1.0] kernel text", "@@RIG vmm_exit=0"]
        );
        assert_eq!(split_markers("@@GUEST a=1"), ["@@GUEST a=1"]);
        assert_eq!(split_markers(""), [""]);
        assert_eq!(
            split_markers("a@@GUESTb"),
            ["a@@GUESTb"],
            "a marker needs its space"
        );
    }
}
