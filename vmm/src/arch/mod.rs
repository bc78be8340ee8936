//! Architecture support. Only x86-64 exists today.

pub mod x86_64;
