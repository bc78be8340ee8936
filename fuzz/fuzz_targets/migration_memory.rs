//! A receiving VMM's `Memory` loop as a hostile sender drives it: any
//! bytes are read as a stream of `Memory` requests (header, table of
//! ranges, their bytes) into guest RAM of two regions with a hole between.
//! Nothing panics; only ranges inside RAM are written; the bytes taken
//! never exceed the budget, which only goes down; a refused request
//! ends the loop (as it ends a migration).
#![no_main]

use std::io::Cursor;

use dax_vmm_fuzz::Memory;
use libfuzzer_sys::fuzz_target;
use vm_memory::{GuestAddress, GuestMemoryBackend};
use vm_state::protocol::{Command, Request};
use vmm::migration::ram_stream::receive_ranges;

const REGION: usize = 64 << 10;
const SECOND: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let Some((budget_bytes, stream)) = data.split_first_chunk::<2>() else {
        return;
    };
    let mem = Memory::from_ranges(&[(GuestAddress(0), REGION), (GuestAddress(SECOND), REGION)])
        .expect("guest RAM");
    let start = u64::from(u16::from_le_bytes(*budget_bytes)) * 16;
    let mut budget = start;
    let mut stream = Cursor::new(stream);
    while let Ok(request) = Request::read_from(&mut stream) {
        if request.command() != Command::Memory {
            break;
        }
        let before = budget;
        match receive_ranges(&mut stream, &request, &mem, &mut budget) {
            Ok(ranges) => {
                let taken: u64 = ranges.iter().map(|r| r.length).sum();
                assert_eq!(before - budget, taken, "the budget is charged what came");
                for r in &ranges {
                    let len = usize::try_from(r.length).expect("a range within RAM");
                    assert!(mem.check_range(GuestAddress(r.gpa), len), "{r:?}");
                }
            }
            Err(_) => {
                assert_eq!(budget, before, "a refused request is not charged");
                break;
            }
        }
        assert!(budget <= start);
    }
});
