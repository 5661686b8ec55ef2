//! Times the server's recovery (snapshot decode + import + log replay) in-process, on
//! copies of a data directory, and prints the fastest of several runs in wall and CPU
//! time. The fastest run is the least disturbed by other load, so before/after
//! comparisons of recovery changes stay meaningful on a busy machine.
//!
//! Make a data directory with a million held locks (W5 keeps it with `--keep-data`),
//! then time it:
//! ```text
//! cargo run --release -p fencelock-bench -- run --workloads w5 --keep-data /tmp/w5
//! cargo run --release -p fencelock-bench --example recovery -- /tmp/w5 5
//! ```

use std::time::Instant;

fn cpu_ms() -> f64 {
    // SAFETY: getrusage only writes the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(usage.ru_utime) + ms(usage.ru_stime)
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name()))?;
        } else if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &to.join(entry.file_name()))?;
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().expect("usage: recovery DATA_DIR [RUNS]"));
    let runs: usize = args.next().map_or(Ok(3), |r| r.parse())?;
    let scratch = tempfile::tempdir()?;
    let (mut best_wall, mut best_cpu) = (f64::MAX, f64::MAX);
    for run in 0..runs {
        let copy = scratch.path().join(format!("copy-{run}"));
        copy_dir(&dir, &copy)?;
        let (wall, cpu) = (Instant::now(), cpu_ms());
        let recovery = fencelock_server::engine::recover(
            fencelock_log::LogOptions::default(),
            &copy,
            &fencelock_core::Config::default(),
            None,
        )?;
        let (core, report) = (recovery.core, recovery.report);
        let (wall, cpu) = (wall.elapsed().as_secs_f64() * 1e3, cpu_ms() - cpu);
        println!(
            "run {run}: {wall:.0} ms wall, {cpu:.0} ms cpu ({} held, {} records replayed)",
            core.stats().holders,
            report.records_replayed
        );
        drop(core);
        std::fs::remove_dir_all(&copy)?;
        best_wall = best_wall.min(wall);
        best_cpu = best_cpu.min(cpu);
    }
    println!("best: {best_wall:.0} ms wall, {best_cpu:.0} ms cpu");

    // One more pass, phase by phase (single-threaded, as before records were decoded
    // beside the snapshot).
    let copy = scratch.path().join("phases");
    copy_dir(&dir, &copy)?;
    let t = Instant::now();
    let (log, recovered) = fencelock_log::Log::open(&copy, fencelock_log::LogOptions::default())?;
    let read_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let audit = fencelock_server::audit::AuditStore::open(
        &copy.join("audit"),
        fencelock_server::audit::AuditConfig::default(),
        true,
    )?;
    let audit_ms = t.elapsed().as_secs_f64() * 1e3;
    let audit_entries = audit.len();
    drop(audit);
    let t = Instant::now();
    let image = match &recovered.snapshot {
        Some(bytes) => Some(fencelock_server::codec::decode_snapshot(bytes)?),
        None => None,
    };
    let decode_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let config = fencelock_core::Config::default();
    let mut core = match image {
        Some(image) => {
            fencelock_core::Core::import_with_room(config, image, recovered.records.len())
                .map_err(anyhow::Error::msg)?
        }
        None => fencelock_core::Core::new(config),
    };
    let import_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let commands = recovered
        .records
        .iter()
        .map(|r| fencelock_server::codec::decode_record(r))
        .collect::<Result<Vec<_>, _>>()?;
    let records_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    for (meta, command) in commands {
        let _ = core.apply(meta.now_ms.max(core.now_ms()), command);
        core.discard_outcomes();
    }
    let apply_ms = t.elapsed().as_secs_f64() * 1e3;
    // The server then logs and applies `Recover` (every lease restarts) before it
    // says it is ready.
    let t = Instant::now();
    let now = core.now_ms() + 1;
    let _ = core.apply(now, fencelock_core::Command::Recover);
    core.discard_outcomes();
    let recover_ms = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "phases: open+read log {read_ms:.0} ms, open audit store {audit_ms:.0} ms \
         ({audit_entries} entries), decode snapshot {decode_ms:.0} ms, import \
         {import_ms:.0} ms, decode records {records_ms:.0} ms, apply records {apply_ms:.0} ms, \
         Recover {recover_ms:.0} ms"
    );
    drop((log, core));
    Ok(())
}
