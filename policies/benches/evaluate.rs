//! Policy evaluation speed: 10,000 rules (path globs spread over 1,000
//! directories, some size rules, a few root-level globs), 1,000,000 lookups
//! of paths that mostly miss and sometimes hit. `cargo bench -p policies`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use policies::{Evaluator, Mode, Policy, Rule};

const RULES: usize = 10_000;
const LOOKUPS: usize = 1_000_000;

fn big_policy() -> Policy {
    let mut rules = Vec::with_capacity(RULES);
    for i in 0..RULES {
        let (path, min_size) = match i % 10 {
            0 => (Some(format!("dir{}/**", i / 10)), None),
            1..=6 => (
                Some(format!("dir{}/sub{}/*.ext{}", i / 10, i % 7, i % 3)),
                None,
            ),
            7 => (Some(format!("dir{}/*.log", i / 10)), Some(4096)),
            8 => (None, Some(1 << (20 + (i % 8)))),
            _ => (Some(format!("**/*.t{}", i % 50)), None),
        };
        rules.push(Rule {
            path,
            min_size,
            max_size: None,
            dax: i % 2 == 0,
        });
    }
    Policy {
        mode: Mode::Inode,
        rules,
        ..Policy::default()
    }
}

fn paths() -> Vec<(String, u64)> {
    (0..1024u64)
        .map(|i| {
            let path = match i % 4 {
                0 => format!("dir{}/sub{}/file{i}.ext{}", i % 1200, i % 7, i % 3),
                1 => format!("dir{}/app.log", i % 1000),
                2 => format!("other/deep/path/file{i}.bin"),
                _ => format!("dir{}/x/y/z/file{i}.t{}", i % 1500, i % 60),
            };
            (path, i << 12)
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let policy = big_policy();
    let evaluator = Evaluator::new(&policy);
    let paths = paths();
    let mut group = c.benchmark_group("evaluate");
    group.sample_size(10);
    group.bench_function("10k rules, 1M lookups", |b| {
        b.iter(|| {
            let mut hits = 0u32;
            for n in 0..LOOKUPS {
                let (p, size) = &paths[n % paths.len()];
                hits += u32::from(evaluator.dax(black_box(p), *size));
            }
            hits
        })
    });
    group.bench_function("compile 10k rules", |b| {
        b.iter(|| Evaluator::new(black_box(&policy)))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
