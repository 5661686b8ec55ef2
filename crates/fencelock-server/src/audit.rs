//! The audit log: who got, lost and took which lock, when and why.
//!
//! **Invariant: an acknowledged change has its audit entry.** Entries are derived
//! from the command log, not written beside it on a best-effort basis:
//!
//! - the engine derives a command's entries ([`entries_for`]) from the command, its
//!   result and the core's events, and hands them to the writer together with the
//!   command's log record;
//! - the writer makes the log record durable (that is the commit: the record holds
//!   everything the entries are made of), appends the entries to the audit store and
//!   its in-memory index, and only then runs the batch's deliveries (replies);
//! - every log record carries a sequence number, the wall-clock time and the actor
//!   ([`crate::codec::RecordMeta`]), so entries that did not reach the audit store's
//!   disk before a crash are rebuilt at start by replaying the log records past the
//!   store's high-water mark ([`AuditStore::high_water`]), identical to the lost ones;
//! - the audit store is synced before the command log drops any record (when a
//!   snapshot makes old segments obsolete), at shutdown, and when it compacts. So it
//!   costs no fdatasync of its own on the commit path.
//!
//! The store is a [`fencelock_log::Log`] in `DATA_DIR/audit`: CRC-framed records (one
//! per batch), preallocated 1 MiB segments, torn-tail detection, and corruption refused
//! with the file and offset. Retention ([`AuditConfig`]) is by age and size; it is
//! applied in memory at every append and on disk by *compaction*: the retained
//! entries are written as the log's snapshot, which deletes the older segments.
//! A compaction happens once the log since the last one is as large as the retained
//! entries (at least [`COMPACT_MIN_BYTES`]), so the rewriting costs amortized O(1) per
//! entry and the disk holds at most about twice `max_bytes` plus one segment.
//!
//! Renew failures change no state and have no log record; they are recorded through
//! the same path with sequence number 0, but a crash before the next audit sync can
//! lose them.
//!
//! The retained entries are also kept in memory (an [`AuditIndex`]) for queries.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};

use fencelock_core::{
    Command, Error as CoreError, EventKind, GrantEnd, Mode, Outcome, Reply, SessionId, Tenant,
    WaitEnd,
};
use fencelock_log::{Log, LogError, LogErrorKind, LogOptions};
use fencelock_proto::vocab::{Event, KindFilter};

use crate::codec::{bad, Dec, DecodeError, Enc, RecordMeta};
use crate::startup::RecoveryError;

/// Log written since the last compaction before the next one, at the least.
pub const COMPACT_MIN_BYTES: u64 = 1 << 20;
/// Size of each preallocated segment of the audit store.
const SEGMENT_BYTES: u64 = 1 << 20;
/// Largest audit record; a larger batch of entries is split.
const MAX_CHUNK_BYTES: usize = 4 << 20;
/// Format version of an audit record (one batch of entries).
const AUDIT_RECORD_VERSION: u8 = 1;
/// A compacted store (the audit log's snapshot) starts with these bytes.
const AUDIT_SNAPSHOT_MAGIC: &[u8; 8] = b"FLAUDS01";

/// How much audit history is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditConfig {
    /// Drop entries older than this (wall clock). `None` = keep by size only.
    pub max_age_ms: Option<u64>,
    /// Keep at most this many bytes of entries, counted as the memory they take
    /// in the index ([`AuditIndex::bytes`], about three times their encoded size
    /// on disk); the oldest go first.
    pub max_bytes: u64,
}

impl Default for AuditConfig {
    /// 30 days, 64 MiB.
    fn default() -> AuditConfig {
        AuditConfig {
            max_age_ms: Some(30 * 24 * 3_600_000),
            max_bytes: 64 << 20,
        }
    }
}

/// What an audit entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AuditKind {
    /// A lock was granted to the acquirer directly.
    Grant,
    /// A lock was handed to a queued request (on a release, expiry or forced release).
    Handoff,
    /// A holder released its lock (or its session was closed).
    Release,
    /// A lease (or the session holding the lock) expired.
    Expiry,
    /// An operator took the lock away; `actor` and `reason` say who and why.
    ForcedRelease,
    /// A session ended (`reason`: `closed` or `expired`).
    SessionEnd,
    /// A renew was refused (`detail`: `not_held`, `expired`, …). Not a state change.
    RenewFailed,
    /// A holder turned its exclusive grant into a shared one (fence kept).
    Downgrade,
    /// An election's leader published a new value (`detail`: the value).
    Proclaim,
}

impl AuditKind {
    /// Every kind.
    pub const ALL: [AuditKind; 9] = [
        AuditKind::Downgrade,
        AuditKind::Proclaim,
        AuditKind::Grant,
        AuditKind::Handoff,
        AuditKind::Release,
        AuditKind::Expiry,
        AuditKind::ForcedRelease,
        AuditKind::SessionEnd,
        AuditKind::RenewFailed,
    ];

    /// The vocabulary event this entry reports: `Grant` and `Handoff` are both
    /// `granted` (with [`Self::is_handoff`] telling them apart).
    pub fn event(self) -> Event {
        match self {
            AuditKind::Grant | AuditKind::Handoff => Event::Granted,
            AuditKind::Release => Event::Released,
            AuditKind::Expiry => Event::Expired,
            AuditKind::ForcedRelease => Event::ForceReleased,
            AuditKind::SessionEnd => Event::SessionEnded,
            AuditKind::RenewFailed => Event::RenewFailed,
            AuditKind::Downgrade => Event::Downgraded,
            AuditKind::Proclaim => Event::Proclaimed,
        }
    }

    /// Whether this is a grant handed to a queued request.
    pub fn is_handoff(self) -> bool {
        self == AuditKind::Handoff
    }

    /// The stable name used in JSON, the CLI and the dashboard: the vocabulary's
    /// ([`Event::name`]).
    pub fn as_str(self) -> &'static str {
        self.event().name()
    }

    /// Whether any of `filters` selects this kind (an empty list selects all).
    pub fn matches(self, filters: &[KindFilter]) -> bool {
        filters.is_empty()
            || filters
                .iter()
                .any(|f| f.matches(self.event(), self.is_handoff()))
    }

    /// The stored form: these codes are on disk and never change meaning.
    fn code(self) -> u8 {
        match self {
            AuditKind::Grant => 1,
            AuditKind::Handoff => 2,
            AuditKind::Release => 3,
            AuditKind::Expiry => 4,
            AuditKind::ForcedRelease => 5,
            AuditKind::SessionEnd => 6,
            AuditKind::RenewFailed => 7,
            AuditKind::Downgrade => 8,
            AuditKind::Proclaim => 9,
        }
    }

    fn from_code(code: u8) -> Option<AuditKind> {
        AuditKind::ALL.into_iter().find(|k| k.code() == code)
    }
}

/// One audit entry. Plain data; the API layers serialize it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    /// Sequence number of the log record of the change (0: not a state change).
    pub seq: u64,
    /// Position among the entries of that record.
    pub index: u32,
    /// Wall-clock time of the commit, ms since the Unix epoch.
    pub wall_ms: u64,
    /// What happened.
    pub kind: AuditKind,
    /// The lock, if one is concerned.
    pub lock: Option<String>,
    /// The grant's fence.
    pub fence: Option<u64>,
    /// The owner text of the grant.
    pub owner: Option<String>,
    /// The session involved, by its handle (16 hex digits,
    /// `input::session_handle`): never the id, which is its owner's secret.
    pub session: Option<String>,
    /// The acquire's idempotency key (direct grants).
    pub request_id: Option<String>,
    /// Who made the change: the token name of the request (`anonymous` with
    /// authentication off), or `server` for what the server did by itself
    /// (expiries, hand-offs, restarts). `None` only for entries rebuilt from records
    /// written before every record carried an actor.
    pub actor: Option<String>,
    /// Why (forced releases; `closed`/`expired` for session ends).
    pub reason: Option<String>,
    /// Time held (ends) or time queued (grants), ms.
    pub duration_ms: u64,
    /// Extra detail: the error code of a refused renew, released count of a session;
    /// for an expiry, `principal <name>`: whose grant or session it was.
    pub detail: Option<String>,
}

impl AuditEntry {
    fn new(meta: &RecordMeta, kind: AuditKind) -> AuditEntry {
        AuditEntry {
            seq: meta.seq,
            index: 0,
            wall_ms: meta.wall_ms,
            kind,
            lock: None,
            fence: None,
            owner: None,
            session: None,
            request_id: None,
            actor: None,
            reason: None,
            duration_ms: 0,
            detail: None,
        }
    }

    fn encode(&self, e: &mut Enc) {
        e.u64(self.seq);
        e.u32(self.index);
        e.u64(self.wall_ms);
        e.u8(self.kind.code());
        e.opt_str(self.lock.as_deref());
        e.opt_u64(self.fence);
        e.opt_str(self.owner.as_deref());
        e.opt_str(self.session.as_deref());
        e.opt_str(self.request_id.as_deref());
        e.opt_str(self.actor.as_deref());
        e.opt_str(self.reason.as_deref());
        e.u64(self.duration_ms);
        e.opt_str(self.detail.as_deref());
    }

    fn decode(d: &mut Dec<'_>) -> Result<AuditEntry, DecodeError> {
        let own = |s: Option<&str>| s.map(str::to_owned);
        Ok(AuditEntry {
            seq: d.u64()?,
            index: d.u32()?,
            wall_ms: d.u64()?,
            kind: {
                let code = d.u8()?;
                AuditKind::from_code(code).ok_or_else(|| bad(format!("audit kind {code}")))?
            },
            lock: own(d.opt_str()?),
            fence: d.opt_u64()?,
            owner: own(d.opt_str()?),
            session: own(d.opt_str()?),
            request_id: own(d.opt_str()?),
            actor: own(d.opt_str()?),
            reason: own(d.opt_str()?),
            duration_ms: d.u64()?,
            detail: own(d.opt_str()?),
        })
    }

    /// Encoded size: what [`Self::encode`] writes.
    #[cfg(test)]
    fn encoded_len(&self) -> u64 {
        let opt_str = |v: &Option<String>| v.as_ref().map_or(1, |s| 1 + 4 + s.len());
        let fence = if self.fence.is_some() { 1 + 8 } else { 1 };
        // seq, index, wall_ms, kind, fence, duration_ms
        let fixed = 8 + 4 + 8 + 1 + fence + 8;
        let strings = opt_str(&self.lock)
            + opt_str(&self.owner)
            + opt_str(&self.session)
            + opt_str(&self.request_id)
            + opt_str(&self.actor)
            + opt_str(&self.reason)
            + opt_str(&self.detail);
        (fixed + strings) as u64
    }
}

/// The audit entries of one applied command, in a deterministic order (the same
/// live and in replay). `meta.seq` is 0 if the command was not logged.
pub fn entries_for(
    meta: &RecordMeta,
    command: &Command,
    result: &Result<Reply, CoreError>,
    outcomes: &[Outcome],
) -> Vec<AuditEntry> {
    let mut out = Vec::new();
    let mut ended_sessions: Vec<(SessionId, Option<Tenant>)> = Vec::new();
    let server = || Some(crate::engine::SERVER_ACTOR.to_owned());
    for outcome in outcomes {
        let Outcome::Event(ev) = outcome else {
            continue;
        };
        let kind = match ev.kind {
            EventKind::Granted if ev.handoff => AuditKind::Handoff,
            EventKind::Granted => AuditKind::Grant,
            EventKind::Ended(GrantEnd::Released) => AuditKind::Release,
            EventKind::Ended(GrantEnd::Expired) => {
                if let Some(s) = ev.session {
                    if !matches!(command, Command::CloseSession { .. })
                        && !ended_sessions.iter().any(|(e, _)| *e == s)
                    {
                        ended_sessions.push((s, ev.tenant.clone()));
                    }
                }
                AuditKind::Expiry
            }
            EventKind::Ended(GrantEnd::ForceReleased) => AuditKind::ForcedRelease,
            EventKind::WaitEnded(WaitEnd::SessionEnded) => {
                if let Some(s) = ev.session {
                    if !matches!(command, Command::CloseSession { .. })
                        && !ended_sessions.iter().any(|(e, _)| *e == s)
                    {
                        ended_sessions.push((s, ev.tenant.clone()));
                    }
                }
                continue;
            }
            EventKind::Downgraded => AuditKind::Downgrade,
            EventKind::Proclaimed => AuditKind::Proclaim,
            EventKind::Queued | EventKind::WaitEnded(_) => continue,
        };
        let mut entry = AuditEntry::new(meta, kind);
        entry.lock = Some(ev.name.as_str().to_owned());
        entry.fence = ev.fence.map(|f| f.get());
        entry.owner = Some(ev.owner.as_str().to_owned());
        entry.session = ev.session.map(crate::input::session_handle);
        entry.duration_ms = ev.duration_ms;
        // The command's caller made its direct effects; expiries and hand-offs the
        // server made (also when processed ahead of some client's command).
        entry.actor = match kind {
            AuditKind::Expiry | AuditKind::Handoff => server(),
            _ => meta.actor.clone(),
        };
        if kind == AuditKind::Expiry {
            entry.detail = ev.tenant.as_ref().map(|t| format!("principal {t}"));
        }
        if kind == AuditKind::Grant {
            if let Command::Acquire(a) = command {
                entry.request_id = a.request_id.as_ref().map(|r| r.as_str().to_owned());
            }
        }
        if kind == AuditKind::ForcedRelease {
            entry.reason = ev.reason.as_ref().map(|r| r.as_str().to_owned());
        }
        if matches!(kind, AuditKind::Grant | AuditKind::Handoff) && ev.mode == Mode::Shared {
            entry.detail = Some("shared".to_owned());
        }
        if kind == AuditKind::Proclaim {
            entry.detail = ev.value.as_ref().map(|v| v.as_str().to_owned());
        }
        out.push(entry);
    }
    for (s, tenant) in ended_sessions {
        let mut entry = AuditEntry::new(meta, AuditKind::SessionEnd);
        entry.session = Some(crate::input::session_handle(s));
        entry.reason = Some("expired".to_owned());
        entry.actor = server();
        entry.detail = tenant.map(|t| format!("principal {t}"));
        out.push(entry);
    }
    match (command, result) {
        (Command::CloseSession { id }, Ok(Reply::SessionClosed { released })) => {
            let mut entry = AuditEntry::new(meta, AuditKind::SessionEnd);
            entry.session = Some(crate::input::session_handle(*id));
            entry.actor = meta.actor.clone();
            entry.reason = Some("closed".to_owned());
            entry.detail = Some(format!("released {released}"));
            out.push(entry);
        }
        (Command::Renew { name, .. }, Err(e)) => {
            let mut entry = AuditEntry::new(meta, AuditKind::RenewFailed);
            entry.actor = meta.actor.clone();
            entry.lock = Some(name.as_str().to_owned());
            entry.detail = Some(e.kind().code().to_owned());
            out.push(entry);
        }
        _ => {}
    }
    for (i, entry) in out.iter_mut().enumerate() {
        entry.index = i as u32;
    }
    out
}

/// A query of the audit log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditQuery {
    /// Only entries about this lock.
    pub lock: Option<String>,
    /// Only entries committed at or after this wall-clock time (ms since the epoch).
    pub since_wall_ms: u64,
    /// Only entries committed at or before this wall-clock time (`u64::MAX`: all).
    pub until_wall_ms: u64,
    /// Only entries of these kinds (empty: all).
    pub kinds: Vec<KindFilter>,
    /// At most this many (the newest ones).
    pub limit: usize,
}

impl AuditQuery {
    /// The newest `limit` entries of every kind, lock and time.
    pub fn newest(limit: usize) -> AuditQuery {
        AuditQuery {
            lock: None,
            since_wall_ms: 0,
            until_wall_ms: u64::MAX,
            kinds: Vec::new(),
            limit,
        }
    }
}

/// The retained entries in memory, oldest first, shared by the writer (which adds
/// entries once they are durable) and the API (which queries them).
///
/// Retention counts what an entry costs in memory, not its encoded size: a first
/// version counted the encoded size and took about five times `max_bytes` (1.02M
/// entries, 345 MB RSS at 64 MiB; issue 19, item 8). Each entry is boxed, so the
/// queue's spare capacity (up to as much again as its length) costs a pointer per
/// entry, not a whole entry.
#[derive(Debug)]
pub struct AuditIndex {
    /// Each entry with its size in memory ([`memory_len`]).
    entries: VecDeque<(Box<AuditEntry>, u64)>,
    bytes: u64,
    config: AuditConfig,
    /// The newest `(seq, index)` ever stored, also after it was pruned.
    high_water: (u64, u32),
}

impl AuditIndex {
    fn new(config: AuditConfig) -> AuditIndex {
        AuditIndex {
            entries: VecDeque::new(),
            bytes: 0,
            config,
            high_water: (0, 0),
        }
    }

    /// Adds an entry, then applies retention.
    fn push(&mut self, entry: AuditEntry, now_wall_ms: u64) {
        if entry.seq > 0 {
            self.high_water = self.high_water.max((entry.seq, entry.index));
        }
        let len = memory_len(&entry);
        self.bytes += len;
        self.entries.push_back((Box::new(entry), len));
        self.prune(now_wall_ms);
    }

    /// Applies retention: by size, then by age.
    fn prune(&mut self, now_wall_ms: u64) {
        let cutoff = self
            .config
            .max_age_ms
            .map_or(0, |age| now_wall_ms.saturating_sub(age));
        while let Some((front, len)) = self.entries.front() {
            if self.bytes <= self.config.max_bytes && front.wall_ms >= cutoff {
                break;
            }
            self.bytes -= *len;
            self.entries.pop_front();
        }
    }

    /// Matching entries, newest last.
    pub fn query(&self, q: &AuditQuery) -> Vec<AuditEntry> {
        let mut out: Vec<AuditEntry> = self
            .entries
            .iter()
            .rev()
            .map(|(e, _)| &**e)
            .filter(|e| e.wall_ms >= q.since_wall_ms && e.wall_ms <= q.until_wall_ms)
            .filter(|e| e.kind.matches(&q.kinds))
            .filter(|e| {
                q.lock
                    .as_deref()
                    .is_none_or(|l| e.lock.as_deref() == Some(l))
            })
            .take(q.limit)
            .cloned()
            .collect();
        out.reverse();
        out
    }

    /// Entries retained.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is retained.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of memory the retained entries take, as counted for retention
    /// ([`memory_len`] of each); at most `max_bytes`.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// What glibc's malloc takes for a request of `n` bytes: an 8-byte header, rounded
/// up to 16, at least 32.
fn alloc_len(n: usize) -> u64 {
    if n == 0 {
        return 0; // an empty String allocates nothing
    }
    ((n + 8 + 15) & !15).max(32) as u64
}

/// The memory an indexed entry takes: its box, the heap buffers of its strings,
/// and two slots of the queue (its own and, at worst, one of spare capacity).
pub fn memory_len(entry: &AuditEntry) -> u64 {
    let strings = [
        &entry.lock,
        &entry.owner,
        &entry.session,
        &entry.request_id,
        &entry.actor,
        &entry.reason,
        &entry.detail,
    ];
    let heap: u64 = strings
        .iter()
        .filter_map(|s| s.as_ref())
        .map(|s| alloc_len(s.capacity()))
        .sum();
    let slot = std::mem::size_of::<(Box<AuditEntry>, u64)>();
    alloc_len(std::mem::size_of::<AuditEntry>()) + heap + 2 * slot as u64
}

/// The durable audit store (owned by the writer thread) and its shared index.
pub struct AuditStore {
    log: Log,
    index: Arc<Mutex<AuditIndex>>,
}

fn corrupt(dir: &Path, what: impl std::fmt::Display) -> RecoveryError {
    RecoveryError::corrupt(
        dir,
        format!(
            "the audit log in {} is corrupt and was not loaded: {what} (move the directory away to start a new audit log)",
            dir.display()
        ),
    )
}

/// Decodes a count and that many entries.
fn decode_entries(d: &mut Dec<'_>, out: &mut Vec<AuditEntry>) -> Result<(), DecodeError> {
    let n = d.count()?;
    for _ in 0..n {
        out.push(AuditEntry::decode(d)?);
    }
    Ok(())
}

/// Wall-clock now, ms since the Unix epoch (0 if the clock is before 1970).
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl AuditStore {
    /// Opens (creating if missing) the audit store in `dir`. A checksum or format
    /// error anywhere is refused with a clear error; nothing corrupt is loaded.
    pub fn open(dir: &Path, config: AuditConfig, fsync: bool) -> Result<AuditStore, RecoveryError> {
        let opts = LogOptions {
            segment_bytes: SEGMENT_BYTES,
            fsync,
        };
        let (log, recovered) = Log::open(dir, opts).map_err(|e| match e.kind() {
            LogErrorKind::Corrupt => {
                let what = e.to_string();
                RecoveryError::from_log("the audit log", e)
                    .with_message(corrupt(dir, what).message().to_owned())
            }
            _ => RecoveryError::from_log("the audit log", e),
        })?;
        if recovered.truncated_tail_bytes > 0 {
            tracing::warn!(
                bytes = recovered.truncated_tail_bytes,
                "audit log: discarded a torn write at its end; its entries are rebuilt from the command log"
            );
        }
        let mut index = AuditIndex::new(config);
        let mut entries = Vec::new();
        if let Some(snap) = &recovered.snapshot {
            let mut d = Dec::new(snap);
            let parsed = (|| {
                if d.take(8)? != AUDIT_SNAPSHOT_MAGIC {
                    return Err(bad("not an audit snapshot"));
                }
                let seq = d.u64()?;
                let idx = d.u32()?;
                decode_entries(&mut d, &mut entries)?;
                d.finish()?;
                Ok((seq, idx))
            })();
            index.high_water =
                parsed.map_err(|e| corrupt(dir, format!("compacted entries: {e}")))?;
        }
        for (i, record) in recovered.records.iter().enumerate() {
            let mut d = Dec::new(record);
            let parsed = (|| {
                let v = d.u8()?;
                if v != AUDIT_RECORD_VERSION {
                    return Err(bad(format!("unknown audit record version {v}")));
                }
                decode_entries(&mut d, &mut entries)?;
                d.finish()
            })();
            parsed.map_err(|e| corrupt(dir, format!("record {i}: {e}")))?;
        }
        let now = wall_ms();
        for entry in entries {
            index.push(entry, now);
        }
        Ok(AuditStore {
            log,
            index: Arc::new(Mutex::new(index)),
        })
    }

    /// The newest `(seq, index)` the store holds: entries of log records with a
    /// smaller sequence number, and the first `index + 1` entries of record `seq`,
    /// are in it; everything after must be rebuilt by replay.
    pub fn high_water(&self) -> (u64, u32) {
        self.index().high_water
    }

    /// The shared in-memory index.
    pub fn shared_index(&self) -> Arc<Mutex<AuditIndex>> {
        self.index.clone()
    }

    fn index(&self) -> std::sync::MutexGuard<'_, AuditIndex> {
        // A panic while holding the lock cannot leave the index half-updated in a
        // way that matters for reads; keep serving.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Entries retained.
    pub fn len(&self) -> usize {
        self.index().len()
    }

    /// Whether no entry is retained.
    pub fn is_empty(&self) -> bool {
        self.index().is_empty()
    }

    /// [`append`](Self::append), then [`sync`](Self::sync).
    pub fn commit(&mut self, entries: Vec<AuditEntry>) -> Result<(), LogError> {
        self.append(entries)?;
        self.sync()
    }

    /// Makes every appended entry durable.
    pub fn sync(&mut self) -> Result<(), LogError> {
        self.log.sync().map(|_| ())
    }

    /// Appends entries (durable at the next [`sync`](Self::sync)) and adds them to
    /// the index; compacts when due. Call only after the log records they derive
    /// from are durable, and sync before those records may be dropped.
    pub fn append(&mut self, entries: Vec<AuditEntry>) -> Result<(), LogError> {
        if entries.is_empty() {
            return Ok(());
        }
        // One record per chunk: version, entry count (patched in), entries. Each
        // entry is encoded once.
        const HEADER: usize = 1 + 4;
        let mut rec = Enc(Vec::with_capacity(HEADER + 160 * entries.len().min(4096)));
        let mut count = 0u32;
        let start = |rec: &mut Enc| {
            rec.0.clear();
            rec.u8(AUDIT_RECORD_VERSION);
            rec.u32(0);
        };
        let flush = |log: &mut Log, rec: &mut Enc, count: &mut u32| {
            rec.0[1..HEADER].copy_from_slice(&count.to_le_bytes());
            *count = 0;
            log.append(&rec.0)
        };
        start(&mut rec);
        for entry in &entries {
            entry.encode(&mut rec);
            count += 1;
            if rec.0.len() - HEADER >= MAX_CHUNK_BYTES {
                flush(&mut self.log, &mut rec, &mut count)?;
                start(&mut rec);
            }
        }
        if count > 0 {
            flush(&mut self.log, &mut rec, &mut count)?;
        }
        let now = wall_ms();
        let retained = {
            let mut index = self.index();
            for entry in entries {
                index.push(entry, now);
            }
            index.bytes
        };
        if self.log.bytes_since_snapshot() >= retained.max(COMPACT_MIN_BYTES) {
            self.compact()?;
        }
        Ok(())
    }

    /// Rewrites the retained entries as the store's snapshot and drops the rest.
    pub fn compact(&mut self) -> Result<(), LogError> {
        let bytes = {
            let mut index = self.index();
            index.prune(wall_ms());
            let mut e = Enc::default();
            e.0.extend_from_slice(AUDIT_SNAPSHOT_MAGIC);
            e.u64(index.high_water.0);
            e.u32(index.high_water.1);
            e.u32(index.entries.len() as u32);
            for (entry, _) in &index.entries {
                entry.encode(&mut e);
            }
            e.0
        };
        self.log.snapshot(&bytes)
    }
}

/// Which regenerated entries recovery must add: those past the high-water mark.
pub(crate) fn missing(high_water: (u64, u32), entries: Vec<AuditEntry>) -> Vec<AuditEntry> {
    entries
        .into_iter()
        .filter(|e| e.seq > 0 && (e.seq, e.index) > high_water)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, index: u32, wall_ms: u64, lock: &str) -> AuditEntry {
        let meta = RecordMeta {
            seq,
            wall_ms,
            ..RecordMeta::default()
        };
        let mut e = AuditEntry::new(&meta, AuditKind::Grant);
        e.index = index;
        e.lock = Some(lock.to_owned());
        e.fence = Some(seq);
        e
    }

    #[test]
    fn entries_round_trip_through_a_reopened_store_and_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let config = AuditConfig::default();
        let now = wall_ms();
        {
            let mut store = AuditStore::open(dir.path(), config.clone(), true).unwrap();
            store
                .commit(vec![entry(1, 0, now, "a"), entry(1, 1, now, "b")])
                .unwrap();
            store.compact().unwrap();
            store.commit(vec![entry(2, 0, now, "a")]).unwrap();
        }
        let store = AuditStore::open(dir.path(), config, true).unwrap();
        assert_eq!(store.high_water(), (2, 0));
        let all = store.index().query(&AuditQuery::newest(10));
        let fences: Vec<_> = all
            .iter()
            .map(|e| (e.lock.clone().unwrap(), e.fence))
            .collect();
        assert_eq!(
            fences,
            vec![
                ("a".to_owned(), Some(1)),
                ("b".to_owned(), Some(1)),
                ("a".to_owned(), Some(2))
            ]
        );
    }

    #[test]
    fn queries_filter_by_kind_with_old_names_and_by_time() {
        let now = wall_ms();
        let mut index = AuditIndex::new(AuditConfig::default());
        let kinds = [
            AuditKind::Grant,
            AuditKind::Handoff,
            AuditKind::ForcedRelease,
            AuditKind::Release,
        ];
        for (i, kind) in kinds.into_iter().enumerate() {
            let mut e = entry(i as u64 + 1, 0, now + i as u64, "a");
            e.kind = kind;
            index.push(e, now);
        }
        let seqs = |kind: &str, since: u64, until: u64| -> Vec<u64> {
            let q = AuditQuery {
                kinds: KindFilter::parse_list(kind).unwrap(),
                since_wall_ms: since,
                until_wall_ms: until,
                ..AuditQuery::newest(10)
            };
            index.query(&q).iter().map(|e| e.seq).collect()
        };
        assert_eq!(seqs("granted", 0, u64::MAX), [1, 2]);
        assert_eq!(seqs("grant", 0, u64::MAX), [1], "old name: direct grants");
        assert_eq!(seqs("handoff", 0, u64::MAX), [2], "old name: hand-offs");
        assert_eq!(seqs("force_released", 0, u64::MAX), [3]);
        assert_eq!(seqs("forced_release,release", 0, u64::MAX), [3, 4]);
        assert_eq!(seqs("queued", 0, u64::MAX), Vec::<u64>::new());
        assert_eq!(seqs("granted,released", now + 1, now + 2), [2]);
        // Every kind's name is the vocabulary's; its stored code never changes.
        for k in AuditKind::ALL {
            assert_eq!(Event::from_name(k.as_str()), Some(k.event()));
            assert_eq!(AuditKind::from_code(k.code()), Some(k));
        }
        assert_eq!(AuditKind::ForcedRelease.code(), 5, "codes are on disk");
        assert_eq!(AuditKind::Handoff.code(), 2, "codes are on disk");
    }

    #[test]
    fn encoded_len_is_the_size_encode_writes() {
        let bare = AuditEntry::new(&RecordMeta::default(), AuditKind::Release);
        let mut full = entry(7, 3, 1_700_000_000_000, "inventory:item:1234");
        full.owner = Some("host-a/42".to_owned());
        full.session = Some("0123456789abcdef0123456789abcdef".to_owned());
        full.request_id = Some("req-1".to_owned());
        full.actor = Some("ops".to_owned());
        full.reason = Some("stuck".to_owned());
        full.duration_ms = 12;
        full.detail = Some("ü".to_owned());
        let mut no_fence = full.clone();
        no_fence.fence = None;
        for e in [bare, full, no_fence] {
            let mut enc = Enc::default();
            e.encode(&mut enc);
            assert_eq!(e.encoded_len(), enc.0.len() as u64, "{e:?}");
        }
    }

    #[test]
    fn retention_drops_the_oldest_by_size_and_by_age() {
        let now = wall_ms();
        let mut index = AuditIndex::new(AuditConfig {
            max_age_ms: Some(60_000),
            max_bytes: u64::MAX,
        });
        index.push(entry(1, 0, now - 120_000, "old"), now);
        index.push(entry(2, 0, now, "new"), now);
        assert_eq!(index.len(), 1, "the entry older than max_age is dropped");
        let one = memory_len(&entry(3, 0, now, "x"));
        let mut index = AuditIndex::new(AuditConfig {
            max_age_ms: None,
            max_bytes: one * 3,
        });
        for seq in 1..=10 {
            index.push(entry(seq, 0, now, "x"), now);
        }
        assert_eq!(index.len(), 3);
        assert!(index.bytes() <= one * 3);
        let kept: Vec<_> = index
            .query(&AuditQuery::newest(100))
            .iter()
            .map(|e| e.seq)
            .collect();
        assert_eq!(kept, vec![8, 9, 10], "the newest are kept");
        assert_eq!(index.high_water, (10, 0));
    }

    #[test]
    fn compaction_bounds_the_disk_and_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let config = AuditConfig {
            max_age_ms: None,
            max_bytes: 256 << 10,
        };
        let now = wall_ms();
        let owner = "o".repeat(200);
        let mut seq = 0;
        {
            let mut store = AuditStore::open(dir.path(), config.clone(), false).unwrap();
            // About 6 MiB of entries, 24 times the retention bound.
            for _ in 0..250 {
                let batch: Vec<AuditEntry> = (0..100)
                    .map(|_| {
                        seq += 1;
                        let mut e = entry(seq, 0, now, "x");
                        e.owner = Some(owner.clone());
                        e
                    })
                    .collect();
                store.commit(batch).unwrap();
            }
        }
        let on_disk: u64 = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        // Snapshot (<= max_bytes) + at most a couple of preallocated segments.
        assert!(
            on_disk <= (256 << 10) + 2 * SEGMENT_BYTES + COMPACT_MIN_BYTES,
            "{on_disk} bytes on disk"
        );
        let store = AuditStore::open(dir.path(), config, false).unwrap();
        let index = store.index();
        assert!(index.bytes() <= 256 << 10);
        assert!(index.len() > 500, "{} entries kept", index.len());
        let newest = index.entries.back().unwrap().0.seq;
        assert_eq!(newest, seq, "the newest entry survives");
        assert_eq!(index.high_water, (seq, 0));
    }

    #[test]
    fn a_corrupt_store_is_refused_with_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut store = AuditStore::open(dir.path(), AuditConfig::default(), true).unwrap();
            store.commit(vec![entry(1, 0, 1, "a")]).unwrap();
            store.commit(vec![entry(2, 0, 1, "a")]).unwrap();
        }
        let seg = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "seg"))
            .unwrap();
        let mut bytes = std::fs::read(&seg).unwrap();
        bytes[56 + 8 + 3] ^= 0xff; // inside the first record's payload (56-byte header)
        std::fs::write(&seg, bytes).unwrap();
        let err = AuditStore::open(dir.path(), AuditConfig::default(), true)
            .err()
            .expect("a corrupt audit log must not load");
        assert!(err.message().contains("audit log"), "{}", err.message());
        assert!(err.message().contains("corrupt"), "{}", err.message());
    }

    #[test]
    fn damaged_entries_are_errors_never_panics() {
        let mut e = Enc::default();
        let mut full = entry(7, 2, 1_700_000_000_000, "lock:1");
        full.reason = Some("why".into());
        full.actor = Some("ops".into());
        full.encode(&mut e);
        let bytes = e.0;
        let mut d = Dec::new(&bytes);
        assert_eq!(AuditEntry::decode(&mut d).unwrap(), full);
        for cut in 0..bytes.len() {
            let mut d = Dec::new(&bytes[..cut]);
            assert!(AuditEntry::decode(&mut d).is_err(), "cut at {cut}");
        }
        let mut bad_kind = bytes.clone();
        bad_kind[8 + 4 + 8] = 99;
        assert!(AuditEntry::decode(&mut Dec::new(&bad_kind)).is_err());
        // A count larger than the input is refused before allocating.
        let mut d = Dec::new(&[0xff, 0xff, 0xff, 0x7f]);
        assert!(decode_entries(&mut d, &mut Vec::new()).is_err());
    }

    #[test]
    fn recovery_adds_only_entries_past_the_high_water_mark() {
        let regenerated = vec![
            entry(5, 0, 1, "a"),
            entry(5, 1, 1, "b"),
            entry(6, 0, 1, "c"),
            entry(0, 0, 1, "renew"),
        ];
        let added: Vec<_> = missing((5, 0), regenerated)
            .into_iter()
            .map(|e| (e.seq, e.index))
            .collect();
        assert_eq!(added, vec![(5, 1), (6, 0)]);
    }
}
