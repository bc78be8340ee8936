//! Shell functions the host-side scripts of the snapshot and migration
//! guest tests and benchmarks share (busybox sh on the VMM's host), put
//! before a script that uses them.

/// Host-side shell functions the snapshot tests share. `alive PID`: the
/// process exists and is not a zombie; `wait_sock PATH`: until a socket is
/// there (bounded); `ended PID`: sets EXIT to its exit status once it has
/// exited ("killed" if it had not after 30 s).
pub const SHELL_HELPERS: &str = r#"
api() { daxprobe http "$@"; }
alive() { [ -e /proc/$1 ] && ! grep -q '^State:.*Z' /proc/$1/status 2>/dev/null; }
wait_sock() { i=0; while [ ! -S $1 ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; }
ended() { i=0; while alive $1 && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; if alive $1; then kill -9 $1; wait $1; EXIT=killed; else wait $1; EXIT="status=$?"; fi; }
"#;

/// The operator's part of a migration with a DAX share, as in Cloud
/// Hypervisor's virtio-fs migration test: `swap_daemon OLD NEW SIZE`
/// removes the old daemon's socket (the new VMM must not reach it) and,
/// in the background, once the daemon OLD has handed over its state and
/// exited (looked for every 20 ms, for at most 60 s), starts a fresh one
/// on the same path and share (window SIZE, e.g. `32M`); it writes
/// whether OLD had exited then (`exited` or `running`) to NEW.old_exit
/// and the fresh daemon's pid to NEW.pid.
pub const DAEMON_SWAP_HELPERS: &str = r#"
swap_daemon() {
    rm -f /tmp/fs.sock $2.pid $2.old_exit
    ( i=0; while alive $1 && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done
      if alive $1; then echo running > $2.old_exit; else echo exited > $2.old_exit; fi
      dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size $3 --log-level warn &
      echo $! > $2.pid; wait ) &
}
"#;

/// Host-side shell functions of the tests whose guest runs `daxprobe
/// mmap-counter` on `share/counter.bin` (the DAX snapshot and the local
/// migration's): `counter` reads its value; `seen TEXT PID` waits
/// (bounded) for TEXT on the serial log while the VMM PID lives; `metric
/// SOCKET NAME` reads fs0's `daxvmm_dax_NAME`; `advancing` prints two
/// readings two seconds apart; `ms` is the emulated host's uptime in
/// milliseconds (10 ms steps).
pub const COUNTER_HELPERS: &str = r#"
counter() { od -An -tu8 -N8 share/counter.bin | tr -d ' '; }
seen() { i=0; while ! grep -q "$1" serial.log 2>/dev/null && [ $i -lt 3000 ] && alive $2; do sleep 0.1; i=$((i+1)); done; }
metric() { api $1 GET /api/v1/vm.dax-metrics | grep -o "daxvmm_dax_$2{device=\"fs0\"} [0-9]*" | head -1 | cut -d' ' -f2; }
advancing() { a=$(counter); sleep 2; b=$(counter); echo "$a $b"; }
ms() { awk '{ printf "%d", $1 * 1000 }' /proc/uptime; }
"#;
