//! `fencelock serve` settings: defaults < TOML config file < environment < flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use fencelock_server::{Durability, EngineConfig, ServerConfig};
use serde::Deserialize;

/// Default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7420";
/// Default data directory.
pub const DEFAULT_DATA_DIR: &str = "./fencelock-data";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Text on a terminal, JSON otherwise.
    Auto,
    /// Human-readable text.
    Text,
    /// One JSON object per line.
    Json,
}

/// Durability as written in flags and config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DurabilityArg {
    /// fdatasync every batch before replying (default).
    Fsync,
    /// UNSAFE, benchmarks only: never sync; a crash can lose grants and repeat fences.
    None,
}

/// Flags of `fencelock serve`; each can also come from the environment.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML config file (flags and environment override it).
    #[arg(long, env = "FENCELOCK_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address for HTTP/JSON and gRPC [default: 127.0.0.1:7420].
    #[arg(long, env = "FENCELOCK_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Data directory [default: ./fencelock-data].
    #[arg(long, env = "FENCELOCK_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// fsync (default) or none (UNSAFE, benchmarks only).
    #[arg(long, env = "FENCELOCK_DURABILITY", value_enum)]
    pub durability: Option<DurabilityArg>,
    /// Log format [default: auto = text on a terminal, JSON otherwise].
    #[arg(long, env = "FENCELOCK_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log filter, e.g. `info` or `fencelock_server=debug` [default: info].
    #[arg(long, env = "FENCELOCK_LOG")]
    pub log_level: Option<String>,
}

/// The config file. Unknown keys are errors, so a typo is never silently ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    data_dir: Option<PathBuf>,
    durability: Option<DurabilityArg>,
    log_format: Option<LogFormat>,
    log_level: Option<String>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    storage: Storage,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limits {
    min_ttl_ms: Option<u64>,
    max_ttl_ms: Option<u64>,
    max_wait_ms: Option<u64>,
    max_lock_delay_ms: Option<u64>,
    max_limit: Option<u32>,
    max_locks: Option<usize>,
    max_waiters_per_lock: Option<usize>,
    max_waiters: Option<usize>,
    max_sessions: Option<usize>,
    max_locks_per_session: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Storage {
    segment_bytes: Option<u64>,
    snapshot_after_bytes: Option<u64>,
}

/// Everything `serve` needs, resolved.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The server's configuration.
    pub server: ServerConfig,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter.
    pub log_level: String,
}

fn load_file(path: &Path) -> Result<FileConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("invalid config file {}", path.display()))
}

/// Merges flags/environment over the config file over the defaults, and checks the
/// result.
pub fn resolve(args: ServeArgs) -> Result<Settings> {
    let file = match &args.config {
        Some(path) => load_file(path)?,
        None => FileConfig::default(),
    };
    let listen = match args.listen.or(file.listen) {
        Some(a) => a,
        None => DEFAULT_LISTEN.parse().expect("valid default"),
    };
    let data_dir = args
        .data_dir
        .or(file.data_dir)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    let durability = match args.durability.or(file.durability) {
        Some(DurabilityArg::None) => Durability::None,
        _ => Durability::Fsync,
    };
    let mut engine = EngineConfig::new(data_dir);
    engine.durability = durability;
    let l = file.limits;
    let c = &mut engine.core;
    macro_rules! set {
        ($($field:ident),*) => { $( if let Some(v) = l.$field { c.$field = v; } )* };
    }
    set!(
        min_ttl_ms,
        max_ttl_ms,
        max_wait_ms,
        max_lock_delay_ms,
        max_limit,
        max_locks,
        max_waiters_per_lock,
        max_waiters,
        max_sessions,
        max_locks_per_session
    );
    if c.min_ttl_ms == 0 || c.min_ttl_ms > c.max_ttl_ms {
        bail!("limits: need 0 < min_ttl_ms <= max_ttl_ms");
    }
    if c.max_limit == 0 || c.max_locks == 0 {
        bail!("limits: max_limit and max_locks must be at least 1");
    }
    if let Some(v) = file.storage.segment_bytes {
        if v < 1 << 20 {
            bail!("storage.segment_bytes must be at least 1 MiB");
        }
        engine.segment_bytes = v;
    }
    if let Some(v) = file.storage.snapshot_after_bytes {
        engine.snapshot_after_bytes = v.max(1);
    }
    Ok(Settings {
        server: ServerConfig::new(listen, engine),
        log_format: args
            .log_format
            .or(file.log_format)
            .unwrap_or(LogFormat::Auto),
        log_level: args
            .log_level
            .or(file.log_level)
            .unwrap_or_else(|| "info".to_owned()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> ServeArgs {
        ServeArgs {
            config: None,
            listen: None,
            data_dir: None,
            durability: None,
            log_format: None,
            log_level: None,
        }
    }

    #[test]
    fn defaults_without_anything() {
        let s = resolve(args()).unwrap();
        assert_eq!(s.server.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(s.server.engine.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert_eq!(s.server.engine.durability, Durability::Fsync);
        assert_eq!(s.log_format, LogFormat::Auto);
    }

    #[test]
    fn flags_win_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fencelock.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9000\"\ndata_dir = \"/tmp/x\"\ndurability = \"none\"\n[limits]\nmax_locks = 7\n",
        )
        .unwrap();
        let mut a = args();
        a.config = Some(path.clone());
        let s = resolve(a).unwrap();
        assert_eq!(s.server.listen.to_string(), "127.0.0.1:9000");
        assert_eq!(s.server.engine.durability, Durability::None);
        assert_eq!(s.server.engine.core.max_locks, 7);
        let mut a = args();
        a.config = Some(path);
        a.listen = Some("127.0.0.1:9001".parse().unwrap());
        a.durability = Some(DurabilityArg::Fsync);
        let s = resolve(a).unwrap();
        assert_eq!(s.server.listen.to_string(), "127.0.0.1:9001");
        assert_eq!(s.server.engine.durability, Durability::Fsync);
        assert_eq!(s.server.engine.data_dir, PathBuf::from("/tmp/x"));
    }

    #[test]
    fn typos_and_bad_values_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        for bad in [
            "lisen = \"127.0.0.1:1\"",
            "listen = 5",
            "durability = \"sometimes\"",
            "[limits]\nmin_ttl_ms = 0",
            "[storage]\nsegment_bytes = 10",
            "not toml at all [",
        ] {
            let path = dir.path().join("c.toml");
            std::fs::write(&path, bad).unwrap();
            let mut a = args();
            a.config = Some(path);
            assert!(resolve(a).is_err(), "accepted {bad:?}");
        }
    }
}
