//! The `fencelock serve` config file: TOML text through the CLI's own
//! `config::resolve` (parse, merge with defaults, validate), compiled here from
//! `crates/fencelock-cli/src/config.rs` because the CLI is a binary crate.

use std::io::Write;

use crate::{plant, MAX_INPUT_BYTES};

#[allow(dead_code, unreachable_pub, missing_docs)]
#[path = "../../fencelock-cli/src/config.rs"]
mod cli_config;

/// Writes `data` to a config file and resolves `fencelock serve --config FILE`
/// with no other flags: must be `Ok` or an error, never a panic.
pub fn config_file(data: &[u8]) {
    if data.len() > MAX_INPUT_BYTES {
        return;
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Paths in the file (`tls.cert`, `tls.key`) are read while resolving; keep the
    // fuzzer away from device files that never end.
    if text.contains("/dev") || text.contains("/proc") || text.contains("/sys") {
        return;
    }
    let mut file = tempfile::NamedTempFile::new().expect("create a temp file");
    file.write_all(data).expect("write the config file");
    let args = cli_config::ServeArgs {
        config: Some(file.path().to_path_buf()),
        listen: None,
        data_dir: None,
        durability: None,
        workers: None,
        writer_poll_us: None,
        log_format: None,
        log_level: None,
        insecure: false,
        tls_cert: None,
        tls_key: None,
        fence_floor: None,
        node_id: None,
        peer_listen: None,
        peers: None,
        advertise_url: None,
        cluster_secret_file: None,
        peer_tls_cert: None,
        peer_tls_key: None,
        peer_tls_ca: None,
        raft_heartbeat_ms: None,
        peer_dial: None,
        join: false,
        no_leader_probe: false,
    };
    if let Ok(settings) = cli_config::resolve(args) {
        if settings.log_level.starts_with("warn") {
            plant("config", "a config with log_level warn resolved");
        }
        // What `serve` checks next, before it binds.
        settings
            .server
            .limits
            .check()
            .expect("resolve returned limits that do not pass check()");
    }
}
