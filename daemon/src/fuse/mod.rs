//! The FUSE protocol over virtqueues: the wire format ([`abi`]),
//! descriptor chains as byte streams ([`chain`]), the server and what it
//! owns ([`server`]), and the request layer that answers each opcode
//! (`handlers`).

pub mod abi;
pub mod chain;
mod handlers;
pub mod server;
