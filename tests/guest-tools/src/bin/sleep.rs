//! `sleep SECONDS` as a program of its own, for guests whose `sleep` is a
//! busybox applet: pjdfstest's ETXTBSY tests copy `$(which sleep)` to a file
//! of another name and run it, which a multi-call binary cannot survive.

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .filter(|s: &f64| s.is_finite() && *s >= 0.0)
        .unwrap_or_else(|| {
            eprintln!("usage: sleep SECONDS");
            std::process::exit(2)
        });
    std::thread::sleep(std::time::Duration::from_secs_f64(secs));
}
