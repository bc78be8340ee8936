//! The FUSE protocol over virtqueues: the wire format, descriptor chains as
//! byte streams, and the request server.

pub mod abi;
pub mod chain;
mod handlers;
pub mod server;
