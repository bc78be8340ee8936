//! `rig-build PACKAGE:BIN...`: the rig's static builds of those workspace
//! binaries, made the way a test makes them (`rig::static_binary`), so that
//! `scripts/test.sh` can build them once before the tests that need them and
//! time that apart.

use std::process::ExitCode;

use test_infra::rig;

fn main() -> ExitCode {
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    if wanted.is_empty() {
        eprintln!("usage: rig-build PACKAGE:BIN...");
        return ExitCode::from(2);
    }
    for arg in &wanted {
        let Some((package, bin)) = arg.split_once(':') else {
            eprintln!("rig-build: {arg:?} is not PACKAGE:BIN");
            return ExitCode::from(2);
        };
        match rig::static_binary(package, bin) {
            Ok(path) => println!("rig-build: {}", path.display()),
            Err(e) => {
                eprintln!("rig-build: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
