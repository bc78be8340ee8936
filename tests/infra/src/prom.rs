//! Samples of the VMM's Prometheus text as `daxprobe http` prints it, on
//! one line (its newlines turned to spaces), for the benchmarks that read
//! `vm.dax-metrics` from a rig run's markers.

/// One sample: its family, its labels without the braces ("" without
/// any), and its value as written (the caller parses it: a `# HELP`
/// line's family and first word come out as a sample whose value does not
/// parse).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample<'a> {
    pub family: &'a str,
    pub labels: &'a str,
    pub value: &'a str,
}

/// Every pair of consecutive words of `text` as a sample.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    let words: Vec<&str> = text.split_whitespace().collect();
    (1..words.len()).map(move |i| {
        let (series, value) = (words[i - 1], words[i]);
        let (family, labels) = match series.split_once('{') {
            Some((f, l)) => (f, l.strip_suffix('}').unwrap_or(l)),
            None => (series, ""),
        };
        Sample {
            family,
            labels,
            value,
        }
    })
}

/// The value of label `name` in `labels` (`a="x",b="y"`), if there.
pub fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels
        .split(',')
        .find_map(|l| l.strip_prefix(name)?.strip_prefix("=\"")?.strip_suffix('"'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_and_labels_are_read_from_one_line() {
        let text = "# TYPE daxvmm_a counter daxvmm_a{device=\"fs0\",stage=\"mmap\"} 0.5 daxvmm_b 3";
        let s: Vec<Sample> = samples(text)
            .filter(|s| s.value.parse::<f64>().is_ok())
            .collect();
        assert_eq!(
            s,
            [
                Sample {
                    family: "daxvmm_a",
                    labels: "device=\"fs0\",stage=\"mmap\"",
                    value: "0.5"
                },
                Sample {
                    family: "daxvmm_b",
                    labels: "",
                    value: "3"
                },
            ]
        );
        assert_eq!(label(s[0].labels, "stage"), Some("mmap"));
        assert_eq!(label(s[0].labels, "device"), Some("fs0"));
        assert_eq!(label(s[0].labels, "dev"), None, "whole names only");
        assert_eq!(label("le=\"+Inf\"", "le"), Some("+Inf"));
        assert_eq!(samples("one").count(), 0);
    }
}
