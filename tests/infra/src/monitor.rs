//! The emulated host's QEMU monitor (HMP over a unix socket), used when a
//! nested run goes silent: it records what the emulated CPU is doing (halted
//! or running, where, with which interrupt state and LAPIC timer), then sends
//! it an NMI and records whether that got it going again.
//!
//! A stall of the emulated host has been seen a few times and never
//! reproduced (docs/testing.md). The dump says which of the candidate causes
//! it was: a CPU halted with interrupts off or no timer armed (a lost
//! wake-up in the emulation), a CPU spinning at one address (a livelock in
//! the emulated host's kernel), or a busy CPU (a slow guest, not a stall).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The monitor's prompt; a command's answer ends with it.
const PROMPT: &[u8] = b"(qemu) ";
const ANSWER_TIMEOUT: Duration = Duration::from_secs(20);

/// A connection to the QEMU human monitor.
pub struct Monitor {
    stream: UnixStream,
}

impl Monitor {
    /// Connects and reads the banner up to the first prompt.
    pub fn connect(path: &Path) -> std::io::Result<Monitor> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut monitor = Monitor { stream };
        monitor.read_to_prompt()?;
        Ok(monitor)
    }

    /// Runs one command and returns its answer, escape sequences and the
    /// echoed command removed.
    pub fn command(&mut self, cmd: &str) -> std::io::Result<String> {
        self.stream.write_all(format!("{cmd}\n").as_bytes())?;
        let raw = self.read_to_prompt()?;
        let text = strip_escapes(&String::from_utf8_lossy(&raw));
        let mut lines: Vec<&str> = text.lines().map(|l| l.trim_end()).collect();
        // The monitor echoes what it was sent.
        if lines.first().is_some_and(|l| l.ends_with(cmd)) {
            lines.remove(0);
        }
        Ok(lines.join("\n"))
    }

    fn read_to_prompt(&mut self) -> std::io::Result<Vec<u8>> {
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while !out.ends_with(PROMPT) {
            if Instant::now() > deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the QEMU monitor did not answer",
                ));
            }
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the QEMU monitor closed",
                    ))
                }
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        out.truncate(out.len() - PROMPT.len());
        Ok(out)
    }
}

/// Removes ANSI escape sequences (the monitor's readline redraws).
fn strip_escapes(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // Parameters, then one final byte in '@'..='~'.
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        if c != '\r' {
            out.push(c);
        }
    }
    out
}

/// The few facts that tell a lost wake-up from a livelock, read off one
/// `info registers` and one `info lapic` answer.
#[derive(Debug, PartialEq)]
pub struct CpuState {
    pub rip: Option<u64>,
    /// The CPU sits in HLT.
    pub halted: bool,
    /// RFLAGS.IF: interrupts can wake it.
    pub interrupts_on: bool,
    /// The LAPIC timer's current count (0: no timer armed).
    pub timer_count: Option<u64>,
    /// Vectors requested (IRR) and in service (ISR), as QEMU prints them.
    pub irr: String,
    pub isr: String,
}

impl CpuState {
    pub fn parse(registers: &str, lapic: &str) -> CpuState {
        let word = |text: &str, key: &str| -> Option<String> {
            let at = text.find(key)? + key.len();
            Some(
                text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric())
                    .collect(),
            )
        };
        let hex = |key: &str| word(registers, key).and_then(|w| u64::from_str_radix(&w, 16).ok());
        let lapic_line = |key: &str| {
            lapic
                .lines()
                .find(|l| l.starts_with(key))
                .map(|l| l[key.len()..].trim().to_string())
                .unwrap_or_else(|| "?".into())
        };
        CpuState {
            rip: hex("RIP="),
            halted: word(registers, "HLT=").as_deref() == Some("1"),
            interrupts_on: hex("RFL=").is_some_and(|f| f & 0x200 != 0),
            timer_count: word(lapic, "current_count = ").and_then(|w| w.parse().ok()),
            irr: lapic_line("IRR"),
            isr: lapic_line("ISR"),
        }
    }

    /// One line for the log.
    pub fn summary(&self) -> String {
        format!(
            "rip={} halted={} interrupts_on={} lapic_timer_count={} irr={} isr={}",
            self.rip.map_or("?".into(), |r| format!("{r:#x}")),
            u8::from(self.halted),
            u8::from(self.interrupts_on),
            self.timer_count.map_or("?".into(), |c| c.to_string()),
            self.irr,
            self.isr
        )
    }
}

/// Where the rig puts a run's monitor socket: a short path, as unix socket
/// paths are limited to 108 bytes and target directories can be deep.
pub fn socket_path(run_name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "dax-rig-{}-{}.mon",
        std::process::id(),
        run_name.chars().take(40).collect::<String>()
    ))
}

/// What the rig records about a silent emulated host, as log lines: the CPU
/// state twice, a second apart (a spinning CPU shows a moving RIP, a halted
/// one does not), each as a summary line and the raw answers (general
/// registers and LAPIC; the FPU and vector registers are left out).
pub fn dump(monitor: &mut Monitor) -> Vec<String> {
    let mut out = Vec::new();
    for round in 0..2 {
        if round == 1 {
            std::thread::sleep(Duration::from_secs(1));
        }
        let mut answers = Vec::new();
        for cmd in ["info registers", "info lapic"] {
            match monitor.command(cmd) {
                Ok(answer) => answers.push(answer),
                Err(e) => {
                    out.push(format!("@@RIG monitor {cmd} failed: {e}"));
                    return out;
                }
            }
        }
        out.push(format!(
            "@@RIG stall_probe cpu {}",
            CpuState::parse(&answers[0], &answers[1]).summary()
        ));
        for (cmd, answer) in ["info registers", "info lapic"].iter().zip(&answers) {
            out.extend(
                answer
                    .lines()
                    .filter(|l| !l.is_empty() && !l.starts_with("FPR") && !l.starts_with("YMM"))
                    .map(|l| format!("@@RIG monitor {cmd}: {l}")),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_cpu_state_from_the_monitor() {
        // As QEMU 7.2 answers for a halted emulated host (abridged).
        let regs = "CPU#0\nRAX=0000000000000000 RBX=0000000000000000\n\
                    RIP=ffffffff81c93f8f RFL=00000206 [-----P-] CPL=0 II=0 A20=1 SMM=0 HLT=1\n";
        let lapic = "LVTT\t 0x000000ec active-hi edge one-shot Fixed  (vec 236)\n\
                     Timer\t DCR=0x3 (divide by 16) initial_count = 11445894 current_count = 4602674\n\
                     ISR\t (none)\nIRR\t 236\n";
        let state = CpuState::parse(regs, lapic);
        assert_eq!(
            state,
            CpuState {
                rip: Some(0xffff_ffff_81c9_3f8f),
                halted: true,
                interrupts_on: true,
                timer_count: Some(4_602_674),
                irr: "236".into(),
                isr: "(none)".into(),
            }
        );
        assert_eq!(
            state.summary(),
            "rip=0xffffffff81c93f8f halted=1 interrupts_on=1 lapic_timer_count=4602674 irr=236 isr=(none)"
        );
        // Interrupts off (RFLAGS.IF clear), running, nothing parsable in the LAPIC.
        let state = CpuState::parse("RIP=ffffffff81000000 RFL=00000046 HLT=0", "");
        assert!(!state.halted && !state.interrupts_on);
        assert_eq!(state.timer_count, None);
    }

    #[test]
    fn strips_readline_escapes() {
        assert_eq!(
            strip_escapes("\u{1b}[Kinfo lapic\r\nx\u{1b}[D"),
            "info lapic\nx"
        );
    }
}
