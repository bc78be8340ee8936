//! `dax-fleet`: a per-host agent that takes DAX policies from etcd and
//! reconciles every local VM to them, writing status back.
//!
//! [`config`] is the agent's own configuration; [`selection`] reads policy
//! objects and picks each VM's; [`store`] is etcd; [`vmm`] the VMM's REST
//! API; [`drain`] moves a host's VMs to others; [`agent`] the loop that
//! ties them together. See docs/fleet.md.

pub mod agent;
pub mod config;
pub mod drain;
pub mod selection;
pub mod store;
pub mod vmm;
