//! The project's integration tests, one test binary with a module per area.
//!
//! The guest tests boot real guests through the rig (`test_infra::rig`) and
//! are `#[ignore]`d: `cargo test -p guest-tests -- --ignored --test-threads=1`
//! runs them (scripts/test.sh does), one at a time, as they share the
//! machine's cores. The rest (`api`, `api_limits`, `kata`, `fleet`, `fleet_drain`) need no
//! guest: they run the real binaries on the host and are part of
//! `cargo test --workspace`. One area alone: `cargo test -p guest-tests --
//! --ignored boot::`.

mod api_common;
mod fleet_common;

mod api;
mod api_events;
mod api_limits;
mod boot;
mod ch_remote;
mod cpu_hotplug;
mod devices;
mod fleet;
mod fleet_drain;
mod fleet_scale;
mod hotplug;
mod kata;
mod kata_sandbox;
mod kata_sandbox_rs;
mod memory_hotplug;
mod migration_local;
mod migration_tcp;
mod pci_segments;
mod pjdfstest;
mod pmem;
mod snapshot;
mod snapshot_dax;
mod virtiofs;
