//! What kind of file a path names, in words, for the errors that refuse a
//! path the operator gave because of its type (a disk that is a FIFO, a
//! vsock socket path that is a regular file).

use std::os::unix::fs::FileTypeExt;

/// `t` as a noun phrase: "a regular file", "a FIFO", ...
pub fn describe(t: std::fs::FileType) -> &'static str {
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "a file of unknown type"
    }
}
