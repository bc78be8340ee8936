use std::path::Path;

use clap::CommandFactory;

use super::virtiofsd::refusal;
use super::*;

fn parse(args: &[&str]) -> Result<Cli, String> {
    let mut cli =
        Cli::try_parse_from([&["dax-virtiofsd"], args].concat()).map_err(|e| e.to_string())?;
    cli.check()?;
    Ok(cli)
}

/// `args` after a listening socket and a share.
fn with_socket(args: &[&str]) -> Result<Cli, String> {
    parse(
        &[
            &["--socket-path", "/run/fs.sock", "--shared-dir", "/s"],
            args,
        ]
        .concat(),
    )
}

/// What Kata's Go runtime (src/runtime/virtcontainers/virtiofsd.go) runs:
/// its four arguments, then the default `virtio_fs_extra_args`.
const KATA_GO: [&str; 6] = [
    "--syslog",
    "--cache=auto",
    "--shared-dir=/run/kata-containers/shared/sandboxes/0123/shared",
    "--fd=3",
    "--thread-pool-size=1",
    "--announce-submounts",
];

#[test]
fn kata_go_runtime_command_line_is_understood() {
    let c = parse(&KATA_GO).unwrap();
    assert!(c.syslog);
    assert_eq!(c.cache, CacheArg::Auto);
    assert_eq!(
        c.shared_dir.as_deref(),
        Some(Path::new(
            "/run/kata-containers/shared/sandboxes/0123/shared"
        ))
    );
    assert_eq!((c.fd, c.socket_path.as_deref()), (Some(3), None));
    assert_eq!(c.thread_pool_size, 1);
    assert!(c.announce_submounts);
    assert_eq!(
        (c.sandbox, c.seccomp, c.log_level),
        (SandboxArg::Namespace, SeccompArg::Kill, LogLevel::Info)
    );
    assert!(!c.xattr);
    // Every cache mode Kata's configuration accepts.
    for (mode, want) in [
        ("never", CacheArg::Never),
        ("metadata", CacheArg::Metadata),
        ("auto", CacheArg::Auto),
        ("always", CacheArg::Always),
    ] {
        let cache = format!("--cache={mode}");
        let argv = [&KATA_GO[..1], &[cache.as_str()], &KATA_GO[2..]].concat();
        assert_eq!(parse(&argv).unwrap().cache, want, "{mode}");
    }
}

/// What Kata's Rust runtime (share_virtio_fs_standalone.rs) runs, with
/// its default extra arguments and `--xattr` (guest SELinux on).
#[test]
fn kata_rust_runtime_command_line_is_understood() {
    let c = parse(&[
        "--socket-path",
        "/run/kata/0123/vhost-fs.sock",
        "--shared-dir",
        "/run/kata-containers/shared/sandboxes/0123/ro",
        "--cache",
        "never",
        "--thread-pool-size=1",
        "-o",
        "announce_submounts",
        "--xattr",
    ])
    .unwrap();
    assert_eq!(
        c.socket_path.as_deref(),
        Some(Path::new("/run/kata/0123/vhost-fs.sock"))
    );
    assert_eq!((c.fd, c.cache, c.syslog), (None, CacheArg::Never, false));
    assert!(c.announce_submounts && c.xattr);
}

#[test]
fn exactly_one_of_socket_path_and_fd_is_required() {
    let e = parse(&["--shared-dir", "/s"]).unwrap_err();
    assert_eq!(e, "--socket-path PATH or --fd N is required (exactly one)");
    let e = parse(&["--shared-dir", "/s", "--fd=3", "--socket-path", "/x"]).unwrap_err();
    assert_eq!(e, "--socket-path and --fd are exclusive: give exactly one");
    // virtiofsd's deprecated spelling of --socket-path.
    let c = parse(&["--shared-dir", "/s", "--socket", "/run/old.sock"]).unwrap();
    assert_eq!(c.socket_path.as_deref(), Some(Path::new("/run/old.sock")));
}

/// Every virtiofsd option the daemon does not implement, as virtiofsd's
/// users spell it, and the name the refusal gives.
const REFUSED: &[(&[&str], &str)] = &[
    (&["--tag=myfs"], "--tag"),
    (&["--socket-group", "kvm"], "--socket-group"),
    (&["--xattrmap", ":map::user.virtiofs.:"], "--xattrmap"),
    (&["--readonly"], "--readonly"),
    (&["--allow-mmap"], "--allow-mmap"),
    (&["--writeback"], "--writeback"),
    (&["--allow-direct-io"], "--allow-direct-io"),
    (&["--modcaps=+sys_admin:-chown"], "--modcaps"),
    (&["--uid-map", ":0:100000:65536:"], "--uid-map"),
    (&["--gid-map", ":0:100000:65536:"], "--gid-map"),
    (&["--translate-uid", "guest:0:1000:1"], "--translate-uid"),
    (&["--translate-gid", "map:0:1000:1"], "--translate-gid"),
    (
        &["--migration-on-error=guest-error"],
        "--migration-on-error=guest-error",
    ),
    (&["--posix-acl"], "--posix-acl=always"),
    (&["--posix-acl=auto"], "--posix-acl=auto"),
    (&["--security-label"], "--security-label=always"),
    (&["--security-label=always"], "--security-label=always"),
    (
        &["--inode-file-handles=prefer"],
        "--inode-file-handles=prefer",
    ),
    (
        &["--inode-file-handles=mandatory"],
        "--inode-file-handles=mandatory",
    ),
    (&["-o", "writeback"], "-o writeback"),
    (&["-o", "allow_direct_io"], "-o allow_direct_io"),
    (&["-o", "posix_acl"], "-o posix_acl"),
    (&["-o", "security_label"], "-o security_label"),
    (
        &["-o", "cache=auto,xattrmap=:map::user.virtiofs.:"],
        "-o xattrmap",
    ),
    (&["-o", "modcaps=+sys_admin"], "-o modcaps"),
];

#[test]
fn every_unsupported_virtiofsd_option_is_refused_by_name() {
    for (args, name) in REFUSED {
        // In Kata's command line, where an extra argument would go.
        let e = parse(&[&KATA_GO[..], args].concat()).unwrap_err();
        assert_eq!(e, refusal(name), "{args:?}");
        assert_eq!(
            e,
            format!("{name} is not supported (virtiofsd option; see docs/virtiofs.md)")
        );
    }
    // And the list above misses none of them.
    let refused: Vec<String> = REFUSED
        .iter()
        .map(|(args, _)| args[0].split('=').next().unwrap().to_string())
        .collect();
    for arg in Cli::command().get_arguments().filter(|a| a.is_hide_set()) {
        let long = format!("--{}", arg.get_long().unwrap());
        assert!(refused.contains(&long), "{long} is not tested");
    }
}

#[test]
fn migration_options_are_taken_in_the_mode_the_daemon_implements() {
    let c = parse(
        &[
            &KATA_GO[..],
            &[
                "--migration-mode=find-paths",
                "--migration-on-error=abort",
                "--migration-verify-handles",
                "--migration-confirm-paths",
            ],
        ]
        .concat(),
    );
    assert!(c.is_ok(), "{:?}", c.err());
    let e = parse(&[&KATA_GO[..], &["--migration-mode", "file-handles"]].concat()).unwrap_err();
    assert!(
        e.contains("--migration-mode=file-handles") && e.contains("CAP_DAC_READ_SEARCH"),
        "{e}"
    );
}

#[test]
fn virtiofsd_options_that_are_what_the_daemon_does_are_taken() {
    for args in [
        &["--posix-acl=never"][..],
        &["--security-label=never"],
        &["--inode-file-handles=never"],
        &["--preserve-noatime"],
        &["--killpriv-v2"],
        &["-f"],
        &[
            "-o",
            "no_writeback,no_allow_direct_io,no_posix_acl,no_security_label",
        ],
        &["-o", "no_posix_lock,no_flock,readdirplus"],
    ] {
        let c = parse(&[&KATA_GO[..], args].concat()).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        assert!(!c.no_readdirplus && !c.no_killpriv_v2, "{args:?}");
    }
    let c = with_socket(&["--no-readdirplus", "--no-killpriv-v2", "-d"]).unwrap();
    assert!(c.no_readdirplus && c.no_killpriv_v2);
    assert_eq!(c.log_level, LogLevel::Debug);
    let c = with_socket(&["-o", "no_readdirplus,no_killpriv_v2,loglevel=err"]).unwrap();
    assert!(c.no_readdirplus && c.no_killpriv_v2);
    assert_eq!(c.log_level, LogLevel::Error);
    assert_eq!(
        with_socket(&["--log-level=off"])
            .unwrap()
            .log_level
            .filter(),
        tracing::level_filters::LevelFilter::OFF
    );
    let c = with_socket(&["-o", "cache=none,sandbox=chroot"]).unwrap();
    assert_eq!((c.cache, c.sandbox), (CacheArg::Never, SandboxArg::Chroot));
    assert_eq!(
        with_socket(&["-o", "cache=metadata"]).unwrap().cache,
        CacheArg::Metadata
    );
    assert_eq!(
        with_socket(&["--rlimit-nofile=0"]).unwrap().rlimit_nofile,
        Some(0)
    );
    // The last of a pair wins, as in virtiofsd.
    let on = |args: &[&str]| with_socket(args).unwrap().announce_submounts;
    assert!(!on(&["--announce-submounts", "--no-announce-submounts"]));
    assert!(on(&["--no-announce-submounts", "--announce-submounts"]));
    assert!(on(&["--no-announce-submounts", "-o", "announce_submounts"]));
}

#[test]
fn legacy_options_are_understood() {
    let c = parse(&["--socket-path", "/x", "-o", "source=/s,cache=always,xattr"]).unwrap();
    assert_eq!(c.shared_dir.as_deref(), Some(Path::new("/s")));
    assert_eq!(c.cache, CacheArg::Always);
    assert!(c.xattr, "-o xattr turns extended attributes on");
    assert!(!c.announce_submounts);
    assert!(!with_socket(&[]).unwrap().xattr, "off by default");
}

#[test]
fn bad_options_are_refused_by_name() {
    let e = with_socket(&["-o", "announce_submounts,bogus"]).unwrap_err();
    assert_eq!(
        e,
        "-o bogus: not a virtiofsd option (see docs/virtiofs.md for the -o options taken)"
    );
    let e = with_socket(&["-o", "cache=sometimes"]).unwrap_err();
    assert_eq!(
        e,
        "-o cache=sometimes: expected none, never, metadata, auto or always"
    );
    let e = with_socket(&["-o", "loglevel=loud"]).unwrap_err();
    assert_eq!(e, "-o loglevel=loud: expected debug, info, warn or err");
    let e = with_socket(&["-o", "sandbox=none"]).unwrap_err();
    assert_eq!(e, "-o sandbox=none: expected namespace or chroot");
    let e = with_socket(&["-o", "source=/t"]).unwrap_err();
    assert_eq!(e, "-o source=/t: the shared directory is already /s");
    let e = with_socket(&["--thread-pool-size", "5000"]).unwrap_err();
    assert!(e.contains("5000") && e.contains("0..=1024"), "{e}");
    // virtiofsd's value sets are kept: a typo is not a refusal.
    let e = with_socket(&["--posix-acl=sometimes"]).unwrap_err();
    assert!(e.contains("sometimes") && e.contains("--posix-acl"), "{e}");
    let e = with_socket(&["--cache=sometimes"]).unwrap_err();
    assert!(e.contains("sometimes") && e.contains("--cache"), "{e}");
}

#[test]
fn capabilities_are_the_vhost_user_json_virtiofsd_prints() {
    let v: serde_json::Value = serde_json::from_str(virtiofsd::CAPABILITIES).unwrap();
    assert_eq!(v["type"], "fs");
    assert_eq!(v["features"], serde_json::json!(["separate-options"]));
    // Asked on its own, as QEMU and libvirt ask it: nothing else required.
    assert!(
        Cli::try_parse_from(["dax-virtiofsd", "--print-capabilities"])
            .unwrap()
            .print_capabilities
    );
}

/// The measurement build's flag (answer before the VMM's ack) does not
/// exist in a daemon built for use: asking for it is a usage error.
#[cfg(not(feature = "bench-unacked-maps"))]
#[test]
fn a_build_for_use_has_no_unacked_maps_flag() {
    let e = with_socket(&["--bench-unacked-maps"]).unwrap_err();
    assert!(e.contains("--bench-unacked-maps"), "{e}");
}

/// In the measurement build the flag is off unless given.
#[cfg(feature = "bench-unacked-maps")]
#[test]
fn the_unacked_maps_flag_is_off_unless_given() {
    assert!(!with_socket(&[]).unwrap().bench_unacked_maps);
    assert!(
        with_socket(&["--bench-unacked-maps"])
            .unwrap()
            .bench_unacked_maps
    );
}
