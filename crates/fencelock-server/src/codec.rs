//! Binary encoding of log records (`(now_ms, Command)`) and snapshots (`StateImage`).
//!
//! Hand-written on purpose (the log must read old records forever, so this file, not
//! a serialization crate, fixes the bytes), little-endian, versioned by a leading
//! byte. Decoding never panics: bad input is a [`DecodeError`]. The log layer
//! checksums every record and snapshot, so a decode error here means a bug or a
//! format from the future, never a torn write.

use fencelock_core::{
    Acquire, Command, Fence, GrantEnd, HolderImage, LeaseImage, LockImage, LockName, Mode, Owner,
    OwnerToken, Quota, Reason, RequestId, SessionId, SessionImage, StateImage, Tenant, Value,
    WaiterImage,
};

/// Format version of log records written before the audit log (no metadata).
const RECORD_VERSION_1: u8 = 1;
/// Format version of log records with a [`RecordMeta`] (sequence number, wall-clock
/// time and actor), which the audit log is rebuilt from after a crash.
const RECORD_VERSION_2: u8 = 2;
/// Format version of log records: version 2, plus the principal and its quota at the
/// end of `Acquire` and `OpenSession` (versions 1 and 2 decode with neither: their
/// sessions are owned by nobody, their grants count against nobody's quota).
const RECORD_VERSION_3: u8 = 3;
/// Format version of log records: version 3, plus the mode (u8: 0 exclusive, 1
/// shared) and the election value (optional string) at the end of every acquire,
/// and the multi-lock, downgrade, proclaim and release-all commands. Older versions
/// decode as exclusive acquires without a value.
pub const RECORD_VERSION: u8 = 4;
/// Format version of snapshots before principals (decoded with none recorded).
const SNAPSHOT_VERSION_1: u8 = 1;
/// Format version of snapshots: version 1 plus a table of the principals (after
/// `next_fence`: count, then each name once, in order of first use) and, for every
/// session, holder and queued request, its principal as an index into it (u32: 0 =
/// none, i = the i-th name). A million holders of one token cost 4 bytes each, not
/// its name each, and decode to one shared name.
const SNAPSHOT_VERSION_2: u8 = 2;
/// Format version of snapshots: version 2, plus after every holder its mode and
/// value, and after every queued request its mode, value and multi-lock group
/// (count, then the parts' tokens). Older versions decode as exclusive, without
/// values or groups.
pub const SNAPSHOT_VERSION: u8 = 3;
/// A snapshot starts with these bytes (inside the log layer's checksummed envelope).
const SNAPSHOT_MAGIC: &[u8; 8] = b"FLSNAP01";

/// The largest service time or duration a record or snapshot may carry: 2^53 ms
/// (285,000 years). The core adds a time and a duration (a deadline is `now_ms +
/// ttl_ms`), so bounding both keeps every sum far from `u64::MAX`: a checksummed
/// but nonsensical value is refused here instead of overflowing in the core.
pub const MAX_TIME_MS: u64 = 1 << 53;

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot decode: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

#[derive(Default)]
pub(crate) struct Enc(pub(crate) Vec<u8>);

impl Enc {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u128(&mut self, v: u128) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn str(&mut self, v: &str) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v.as_bytes());
    }
    pub(crate) fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.u64(v);
            }
            None => self.u8(0),
        }
    }
    pub(crate) fn opt_u128(&mut self, v: Option<u128>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.u128(v);
            }
            None => self.u8(0),
        }
    }
    pub(crate) fn opt_str(&mut self, v: Option<&str>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.str(v);
            }
            None => self.u8(0),
        }
    }
}

pub(crate) struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

pub(crate) fn bad(what: impl Into<String>) -> DecodeError {
    DecodeError(what.into())
}

impl<'a> Dec<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Dec<'a> {
        Dec { buf, pos: 0 }
    }
    /// Bytes read so far.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| bad(format!("truncated at byte {}", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub(crate) fn u128(&mut self) -> Result<u128, DecodeError> {
        Ok(u128::from_le_bytes(
            self.take(16)?.try_into().expect("16 bytes"),
        ))
    }
    pub(crate) fn str(&mut self) -> Result<&'a str, DecodeError> {
        let len = self.u32()? as usize;
        std::str::from_utf8(self.take(len)?).map_err(|_| bad("invalid UTF-8"))
    }
    /// A service time or duration, at most [`MAX_TIME_MS`].
    pub(crate) fn time(&mut self) -> Result<u64, DecodeError> {
        let at = self.pos;
        let v = self.u64()?;
        if v > MAX_TIME_MS {
            return Err(bad(format!(
                "time {v} ms at byte {at} is above the limit of {MAX_TIME_MS} ms"
            )));
        }
        Ok(v)
    }
    pub(crate) fn opt_time(&mut self) -> Result<Option<u64>, DecodeError> {
        Ok(if self.flag()? {
            Some(self.time()?)
        } else {
            None
        })
    }
    pub(crate) fn flag(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(bad(format!("bad option flag {b}"))),
        }
    }
    pub(crate) fn opt_u64(&mut self) -> Result<Option<u64>, DecodeError> {
        Ok(if self.flag()? {
            Some(self.u64()?)
        } else {
            None
        })
    }
    pub(crate) fn opt_u128(&mut self) -> Result<Option<u128>, DecodeError> {
        Ok(if self.flag()? {
            Some(self.u128()?)
        } else {
            None
        })
    }
    pub(crate) fn opt_str(&mut self) -> Result<Option<&'a str>, DecodeError> {
        Ok(if self.flag()? {
            Some(self.str()?)
        } else {
            None
        })
    }
    pub(crate) fn name(&mut self) -> Result<LockName, DecodeError> {
        LockName::recorded(self.str()?).map_err(|e| bad(e.to_string()))
    }
    pub(crate) fn owner(&mut self) -> Result<Owner, DecodeError> {
        Owner::new(self.str()?).map_err(|e| bad(e.to_string()))
    }
    pub(crate) fn request_id(&mut self) -> Result<Option<RequestId>, DecodeError> {
        self.opt_str()?
            .map(|s| RequestId::new(s).map_err(|e| bad(e.to_string())))
            .transpose()
    }
    pub(crate) fn fence(&mut self) -> Result<Fence, DecodeError> {
        Fence::new(self.u64()?).ok_or_else(|| bad("zero fence"))
    }
    pub(crate) fn count(&mut self) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        // Every element takes at least one byte; refuse counts the input cannot hold.
        if n > self.buf.len() - self.pos {
            return Err(bad(format!("count {n} exceeds the remaining input")));
        }
        Ok(n)
    }

    /// An acquire's fields; `principals` and `kinds` say whether the record's
    /// version carries the principal and quota, and the mode and value.
    fn acquire(&mut self, principals: bool, kinds: bool) -> Result<Acquire, DecodeError> {
        let mut a = Acquire {
            name: self.name()?,
            token: OwnerToken::from_u128(self.u128()?),
            ttl_ms: self.opt_u64()?,
            wait_ms: self.u64()?,
            owner: self.owner()?,
            request_id: self.request_id()?,
            limit: self.u32()?,
            lock_delay_ms: self.u64()?,
            session: self.opt_u128()?.map(SessionId::from_u128),
            tenant: None,
            quota: None,
            mode: Mode::Exclusive,
            value: None,
        };
        if principals {
            a.tenant = self.tenant()?;
            a.quota = self.quota()?;
        }
        if kinds {
            (a.mode, a.value) = self.mode_value()?;
        }
        Ok(a)
    }

    fn mode_value(&mut self) -> Result<(Mode, Option<Value>), DecodeError> {
        let mode = match self.u8()? {
            0 => Mode::Exclusive,
            1 => Mode::Shared,
            b => return Err(bad(format!("bad mode {b}"))),
        };
        let value = match self.opt_str()? {
            Some(v) => Some(Value::new(v).map_err(|e| bad(e.to_string()))?),
            None => None,
        };
        Ok((mode, value))
    }

    fn tenant(&mut self) -> Result<Option<Tenant>, DecodeError> {
        self.opt_str()?
            .map(|s| Tenant::new(s).map_err(|e| bad(e.to_string())))
            .transpose()
    }
    fn quota(&mut self) -> Result<Option<Quota>, DecodeError> {
        Ok(if self.flag()? {
            Some(Quota {
                max_sessions: self.u32()?,
                max_held_locks: self.u32()?,
                max_waiters: self.u32()?,
            })
        } else {
            None
        })
    }
    pub(crate) fn finish(self) -> Result<(), DecodeError> {
        if self.pos != self.buf.len() {
            return Err(bad(format!("{} trailing bytes", self.buf.len() - self.pos)));
        }
        Ok(())
    }
}

mod tag {
    pub const ACQUIRE: u8 = 1;
    pub const RENEW: u8 = 2;
    pub const RELEASE: u8 = 3;
    pub const FORCE_RELEASE: u8 = 4;
    pub const CANCEL_WAIT: u8 = 5;
    pub const OPEN_SESSION: u8 = 6;
    pub const KEEP_ALIVE: u8 = 7;
    pub const CLOSE_SESSION: u8 = 8;
    pub const TICK: u8 = 9;
    pub const RECOVER: u8 = 10;
    pub const RAISE_FENCE_FLOOR: u8 = 11;
    pub const PROMOTE: u8 = 12;
    pub const ACQUIRE_ALL: u8 = 13;
    pub const DOWNGRADE: u8 = 14;
    pub const PROCLAIM: u8 = 15;
    pub const RELEASE_ALL: u8 = 16;
}

/// What a log record carries besides its command: enough to rebuild the audit
/// entries of the command by replay.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordMeta {
    /// The record's sequence number: increases by one per record, across restarts
    /// and snapshots. 0 for records written before version 2 (never audited).
    pub seq: u64,
    /// Service time the command was applied at (the core's clock).
    pub now_ms: u64,
    /// Wall-clock time (ms since the Unix epoch) the command was applied at; shown to
    /// operators only, never used for decisions.
    pub wall_ms: u64,
    /// Who asked: the token name (`anonymous` with authentication off), `server`
    /// for what the server did by itself (expiries, orphaned grants, restarts).
    /// `None` in records written before every command carried one.
    pub actor: Option<String>,
}

/// Encodes one log record: its metadata and the command applied.
pub fn encode_record(meta: &RecordMeta, command: &Command) -> Vec<u8> {
    let mut e = Enc::default();
    e.u8(RECORD_VERSION);
    e.u64(meta.now_ms);
    e.u64(meta.seq);
    e.u64(meta.wall_ms);
    e.opt_str(meta.actor.as_deref());
    match command {
        Command::Acquire(a) => {
            e.u8(tag::ACQUIRE);
            e.acquire(a);
        }
        Command::AcquireAll(parts) => {
            e.u8(tag::ACQUIRE_ALL);
            e.u32(parts.len() as u32);
            for a in parts {
                e.acquire(a);
            }
        }
        Command::Downgrade { name, token } => {
            e.u8(tag::DOWNGRADE);
            e.str(name.as_str());
            e.u128(token.as_u128());
        }
        Command::Proclaim { name, token, value } => {
            e.u8(tag::PROCLAIM);
            e.str(name.as_str());
            e.u128(token.as_u128());
            e.str(value.as_str());
        }
        Command::ReleaseAll { grants } => {
            e.u8(tag::RELEASE_ALL);
            e.u32(grants.len() as u32);
            for (name, token) in grants {
                e.str(name.as_str());
                e.u128(token.as_u128());
            }
        }
        Command::Renew {
            name,
            token,
            ttl_ms,
        } => {
            e.u8(tag::RENEW);
            e.str(name.as_str());
            e.u128(token.as_u128());
            e.opt_u64(*ttl_ms);
        }
        Command::Release { name, token } => {
            e.u8(tag::RELEASE);
            e.str(name.as_str());
            e.u128(token.as_u128());
        }
        Command::ForceRelease {
            name,
            fence,
            reason,
        } => {
            e.u8(tag::FORCE_RELEASE);
            e.str(name.as_str());
            e.opt_u64(fence.map(Fence::get));
            e.str(reason.as_str());
        }
        Command::CancelWait { name, token } => {
            e.u8(tag::CANCEL_WAIT);
            e.str(name.as_str());
            e.u128(token.as_u128());
        }
        Command::OpenSession {
            id,
            ttl_ms,
            owner,
            tenant,
            quota,
        } => {
            e.u8(tag::OPEN_SESSION);
            e.u128(id.as_u128());
            e.u64(*ttl_ms);
            e.str(owner.as_str());
            e.tenant_quota(tenant.as_ref(), quota.as_ref());
        }
        Command::KeepAlive { id } => {
            e.u8(tag::KEEP_ALIVE);
            e.u128(id.as_u128());
        }
        Command::CloseSession { id } => {
            e.u8(tag::CLOSE_SESSION);
            e.u128(id.as_u128());
        }
        Command::Tick => e.u8(tag::TICK),
        Command::Recover => e.u8(tag::RECOVER),
        Command::Promote => e.u8(tag::PROMOTE),
        Command::RaiseFenceFloor { floor } => {
            e.u8(tag::RAISE_FENCE_FLOOR);
            e.u64(*floor);
        }
    }
    e.0
}

/// Decodes one log record (either version).
pub fn decode_record(bytes: &[u8]) -> Result<(RecordMeta, Command), DecodeError> {
    let mut d = Dec::new(bytes);
    let version = d.u8()?;
    let meta = match version {
        RECORD_VERSION_1 => RecordMeta {
            now_ms: d.time()?,
            ..RecordMeta::default()
        },
        RECORD_VERSION_2 | RECORD_VERSION_3 | RECORD_VERSION => RecordMeta {
            now_ms: d.time()?,
            seq: d.u64()?,
            wall_ms: d.u64()?,
            actor: d.opt_str()?.map(str::to_owned),
        },
        v => return Err(bad(format!("unknown record version {v}"))),
    };
    let principals = version >= RECORD_VERSION_3;
    let kinds = version >= RECORD_VERSION;
    let command = match d.u8()? {
        tag::ACQUIRE => Command::Acquire(d.acquire(principals, kinds)?),
        tag::ACQUIRE_ALL if kinds => {
            let n = d.count()?;
            let mut parts = Vec::with_capacity(n.min(64));
            for _ in 0..n {
                parts.push(d.acquire(principals, kinds)?);
            }
            Command::AcquireAll(parts)
        }
        tag::DOWNGRADE if kinds => Command::Downgrade {
            name: d.name()?,
            token: OwnerToken::from_u128(d.u128()?),
        },
        tag::PROCLAIM if kinds => Command::Proclaim {
            name: d.name()?,
            token: OwnerToken::from_u128(d.u128()?),
            value: Value::new(d.str()?).map_err(|e| bad(e.to_string()))?,
        },
        tag::RELEASE_ALL if kinds => {
            let n = d.count()?;
            let mut grants = Vec::with_capacity(n.min(64));
            for _ in 0..n {
                grants.push((d.name()?, OwnerToken::from_u128(d.u128()?)));
            }
            Command::ReleaseAll { grants }
        }
        tag::RENEW => Command::Renew {
            name: d.name()?,
            token: OwnerToken::from_u128(d.u128()?),
            ttl_ms: d.opt_u64()?,
        },
        tag::RELEASE => Command::Release {
            name: d.name()?,
            token: OwnerToken::from_u128(d.u128()?),
        },
        tag::FORCE_RELEASE => Command::ForceRelease {
            name: d.name()?,
            fence: match d.opt_u64()? {
                Some(f) => Some(Fence::new(f).ok_or_else(|| bad("zero fence"))?),
                None => None,
            },
            reason: Reason::new(d.str()?).map_err(|e| bad(e.to_string()))?,
        },
        tag::CANCEL_WAIT => Command::CancelWait {
            name: d.name()?,
            token: OwnerToken::from_u128(d.u128()?),
        },
        tag::OPEN_SESSION => Command::OpenSession {
            id: SessionId::from_u128(d.u128()?),
            ttl_ms: d.u64()?,
            owner: d.owner()?,
            tenant: if principals { d.tenant()? } else { None },
            quota: if principals { d.quota()? } else { None },
        },
        tag::KEEP_ALIVE => Command::KeepAlive {
            id: SessionId::from_u128(d.u128()?),
        },
        tag::CLOSE_SESSION => Command::CloseSession {
            id: SessionId::from_u128(d.u128()?),
        },
        tag::TICK => Command::Tick,
        tag::RECOVER => Command::Recover,
        tag::PROMOTE => Command::Promote,
        tag::RAISE_FENCE_FLOOR => Command::RaiseFenceFloor { floor: d.u64()? },
        t => return Err(bad(format!("unknown command tag {t}"))),
    };
    d.finish()?;
    Ok((meta, command))
}

/// Format version (leading byte) of a replicated record that carries a state image
/// instead of a command: a single server's state imported into a cluster (see
/// [`Replicated::Import`]). Only ever inside a Raft entry, never in a single
/// server's log, whose decoder ([`decode_record`]) refuses it.
const IMPORT_RECORD_VERSION: u8 = 0x49;

/// What a Raft entry's record holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replicated {
    /// A command, as in a single server's log.
    Command(RecordMeta, Command),
    /// A single server's whole state, to become the cluster's: every member applies
    /// it to an empty state only.
    Import {
        /// When and by whom it was proposed.
        meta: RecordMeta,
        /// [`encode_snapshot`] of the state (decoded when applied).
        snapshot: Vec<u8>,
    },
}

/// Encodes an import record: its metadata and the state image's bytes.
pub fn encode_import(meta: &RecordMeta, snapshot: &[u8]) -> Vec<u8> {
    let mut e = Enc::default();
    e.u8(IMPORT_RECORD_VERSION);
    e.u64(meta.now_ms);
    e.u64(meta.seq);
    e.u64(meta.wall_ms);
    e.opt_str(meta.actor.as_deref());
    e.u64(snapshot.len() as u64);
    e.0.extend_from_slice(snapshot);
    e.0
}

/// Decodes a Raft entry's record: a command record (any version) or an import.
pub fn decode_replicated(bytes: &[u8]) -> Result<Replicated, DecodeError> {
    if bytes.first() != Some(&IMPORT_RECORD_VERSION) {
        let (meta, command) = decode_record(bytes)?;
        return Ok(Replicated::Command(meta, command));
    }
    let mut d = Dec::new(bytes);
    d.u8()?;
    let meta = RecordMeta {
        now_ms: d.time()?,
        seq: d.u64()?,
        wall_ms: d.u64()?,
        actor: d.opt_str()?.map(str::to_owned),
    };
    let len = usize::try_from(d.u64()?).map_err(|_| bad("import length overflows"))?;
    let snapshot = d.take(len)?.to_vec();
    d.finish()?;
    Ok(Replicated::Import { meta, snapshot })
}

impl Enc {
    fn acquire(&mut self, a: &Acquire) {
        self.str(a.name.as_str());
        self.u128(a.token.as_u128());
        self.opt_u64(a.ttl_ms);
        self.u64(a.wait_ms);
        self.str(a.owner.as_str());
        self.opt_str(a.request_id.as_ref().map(RequestId::as_str));
        self.u32(a.limit);
        self.u64(a.lock_delay_ms);
        self.opt_u128(a.session.map(SessionId::as_u128));
        self.tenant_quota(a.tenant.as_ref(), a.quota.as_ref());
        self.mode_value(a.mode, a.value.as_ref());
    }

    fn mode_value(&mut self, mode: Mode, value: Option<&Value>) {
        self.u8(match mode {
            Mode::Exclusive => 0,
            Mode::Shared => 1,
        });
        self.opt_str(value.map(Value::as_str));
    }

    fn tenant_quota(&mut self, tenant: Option<&Tenant>, quota: Option<&Quota>) {
        self.opt_str(tenant.map(Tenant::as_str));
        match quota {
            Some(q) => {
                self.u8(1);
                self.u32(q.max_sessions);
                self.u32(q.max_held_locks);
                self.u32(q.max_waiters);
            }
            None => self.u8(0),
        }
    }
}

fn end_code(end: GrantEnd) -> u8 {
    match end {
        GrantEnd::Released => 1,
        GrantEnd::Expired => 2,
        GrantEnd::ForceReleased => 3,
    }
}

/// Encodes a whole state image.
pub fn encode_snapshot(image: &StateImage) -> Vec<u8> {
    encode_snapshot_version(image, SNAPSHOT_VERSION)
}

/// [`encode_snapshot`] in format `version` (an older one only for tests: it drops
/// the principals).
fn encode_snapshot_version(image: &StateImage, version: u8) -> Vec<u8> {
    let principals = version >= SNAPSHOT_VERSION_2;
    let kinds = version >= SNAPSHOT_VERSION;
    let mut e = Enc::default();
    e.0.extend_from_slice(SNAPSHOT_MAGIC);
    e.u8(version);
    e.u64(image.now_ms);
    e.u64(image.next_fence);
    let mut table: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
    if principals {
        let used =
            image
                .sessions
                .iter()
                .map(|s| s.tenant.as_ref())
                .chain(image.locks.iter().flat_map(|l| {
                    let holders = l.holders.iter().map(|h| h.tenant.as_ref());
                    holders.chain(l.waiters.iter().map(|w| w.tenant.as_ref()))
                }));
        let mut names: Vec<&str> = Vec::new();
        for t in used.flatten() {
            if !table.contains_key(t.as_str()) {
                names.push(t.as_str());
                table.insert(t.as_str(), names.len() as u32);
            }
        }
        e.u32(names.len() as u32);
        for name in names {
            e.str(name);
        }
    }
    let index = |t: Option<&Tenant>| t.map_or(0, |t| table[t.as_str()]);
    e.u32(image.sessions.len() as u32);
    for s in &image.sessions {
        e.u128(s.id.as_u128());
        e.str(s.owner.as_str());
        if principals {
            e.u32(index(s.tenant.as_ref()));
        }
        e.u64(s.ttl_ms);
        e.u64(s.deadline_ms);
    }
    e.u32(image.locks.len() as u32);
    for l in &image.locks {
        e.str(l.name.as_str());
        e.u32(l.limit);
        e.u64(l.blocked_until_ms);
        e.u32(l.holders.len() as u32);
        for h in &l.holders {
            e.u128(h.token.as_u128());
            e.u64(h.fence.get());
            e.str(h.owner.as_str());
            e.opt_str(h.request_id.as_ref().map(RequestId::as_str));
            match h.lease {
                LeaseImage::Own {
                    ttl_ms,
                    deadline_ms,
                } => {
                    e.u8(0);
                    e.u64(ttl_ms);
                    e.u64(deadline_ms);
                }
                LeaseImage::Session(id) => {
                    e.u8(1);
                    e.u128(id.as_u128());
                }
            }
            e.u64(h.granted_at_ms);
            e.u64(h.lock_delay_ms);
            if principals {
                e.u32(index(h.tenant.as_ref()));
            }
            if kinds {
                e.mode_value(h.mode, h.value.as_ref());
            }
        }
        e.u32(l.waiters.len() as u32);
        for w in &l.waiters {
            e.u128(w.token.as_u128());
            e.str(w.owner.as_str());
            e.opt_str(w.request_id.as_ref().map(RequestId::as_str));
            e.opt_u64(w.ttl_ms);
            e.opt_u128(w.session.map(SessionId::as_u128));
            e.u64(w.lock_delay_ms);
            e.u64(w.enqueued_at_ms);
            e.u64(w.wait_deadline_ms);
            if principals {
                e.u32(index(w.tenant.as_ref()));
            }
            if kinds {
                e.mode_value(w.mode, w.value.as_ref());
                e.u32(w.group.len() as u32);
                for t in &w.group {
                    e.u128(t.as_u128());
                }
            }
        }
    }
    e.u32(image.recent_ends.len() as u32);
    for (token, name, end) in &image.recent_ends {
        e.u128(token.as_u128());
        e.str(name.as_str());
        e.u8(end_code(*end));
    }
    e.0
}

/// Decodes a whole state image.
pub fn decode_snapshot(bytes: &[u8]) -> Result<StateImage, DecodeError> {
    let mut d = Dec::new(bytes);
    if d.take(SNAPSHOT_MAGIC.len())? != SNAPSHOT_MAGIC {
        return Err(bad("not a fencelock snapshot (bad magic)"));
    }
    let version = d.u8()?;
    if !(SNAPSHOT_VERSION_1..=SNAPSHOT_VERSION).contains(&version) {
        return Err(bad(format!("unknown snapshot version {version}")));
    }
    let principals = version >= SNAPSHOT_VERSION_2;
    let kinds = version >= SNAPSHOT_VERSION;
    let now_ms = d.time()?;
    let next_fence = d.u64()?;
    let mut table: Vec<Tenant> = Vec::new();
    if principals {
        for _ in 0..d.count()? {
            let name = d.str()?;
            if table.iter().any(|t| t.as_str() == name) {
                return Err(bad(format!("principal {name:?} listed twice")));
            }
            table.push(Tenant::new(name).map_err(|e| bad(e.to_string()))?);
        }
    }
    // One encoding per image: names are listed in order of first use, each used.
    let mut seen = 0;
    let mut tenant = |d: &mut Dec<'_>| -> Result<Option<Tenant>, DecodeError> {
        if !principals {
            return Ok(None);
        }
        let i = d.u32()? as usize;
        if i == 0 {
            return Ok(None);
        }
        if i > seen + 1 || i > table.len() {
            return Err(bad(format!("principal index {i} out of order or range")));
        }
        seen = seen.max(i);
        Ok(Some(table[i - 1].clone()))
    };
    let mut sessions = Vec::new();
    for _ in 0..d.count()? {
        sessions.push(SessionImage {
            id: SessionId::from_u128(d.u128()?),
            owner: d.owner()?,
            tenant: tenant(&mut d)?,
            ttl_ms: d.time()?,
            deadline_ms: d.time()?,
        });
    }
    // Counts are bounded by the input (one byte per element at least), and a lock
    // takes far more than 16 bytes: sized up front without trusting the count.
    let count = d.count()?;
    let mut locks = Vec::with_capacity(count.min((bytes.len() - d.pos()) / 16));
    // Most holders share a few owner texts (often the empty one): one allocation
    // for a run of equal owners instead of one per holder.
    let mut last_owner = Owner::default();
    let mut owner = |d: &mut Dec<'_>| -> Result<Owner, DecodeError> {
        let text = d.str()?;
        if text != last_owner.as_str() {
            last_owner = Owner::new(text).map_err(|e| bad(e.to_string()))?;
        }
        Ok(last_owner.clone())
    };
    for _ in 0..count {
        let name = d.name()?;
        let limit = d.u32()?;
        let blocked_until_ms = d.time()?;
        let mut holders = Vec::new();
        for _ in 0..d.count()? {
            let mut holder = HolderImage {
                token: OwnerToken::from_u128(d.u128()?),
                fence: d.fence()?,
                owner: owner(&mut d)?,
                request_id: d.request_id()?,
                lease: match d.u8()? {
                    0 => LeaseImage::Own {
                        ttl_ms: d.time()?,
                        deadline_ms: d.time()?,
                    },
                    1 => LeaseImage::Session(SessionId::from_u128(d.u128()?)),
                    b => return Err(bad(format!("bad lease kind {b}"))),
                },
                granted_at_ms: d.time()?,
                lock_delay_ms: d.time()?,
                tenant: tenant(&mut d)?,
                mode: Mode::Exclusive,
                value: None,
            };
            if kinds {
                (holder.mode, holder.value) = d.mode_value()?;
            }
            holders.push(holder);
        }
        let mut waiters = Vec::new();
        for _ in 0..d.count()? {
            let mut waiter = WaiterImage {
                token: OwnerToken::from_u128(d.u128()?),
                owner: d.owner()?,
                request_id: d.request_id()?,
                ttl_ms: d.opt_time()?,
                session: d.opt_u128()?.map(SessionId::from_u128),
                lock_delay_ms: d.time()?,
                enqueued_at_ms: d.time()?,
                wait_deadline_ms: d.time()?,
                tenant: tenant(&mut d)?,
                mode: Mode::Exclusive,
                value: None,
                group: Vec::new(),
            };
            if kinds {
                (waiter.mode, waiter.value) = d.mode_value()?;
                for _ in 0..d.count()? {
                    waiter.group.push(OwnerToken::from_u128(d.u128()?));
                }
            }
            waiters.push(waiter);
        }
        locks.push(LockImage {
            name,
            limit,
            blocked_until_ms,
            holders,
            waiters,
        });
    }
    let mut recent_ends = Vec::new();
    for _ in 0..d.count()? {
        let token = OwnerToken::from_u128(d.u128()?);
        let name = d.name()?;
        let end = match d.u8()? {
            1 => GrantEnd::Released,
            2 => GrantEnd::Expired,
            3 => GrantEnd::ForceReleased,
            b => return Err(bad(format!("bad grant end {b}"))),
        };
        recent_ends.push((token, name, end));
    }
    if seen != table.len() {
        return Err(bad("a listed principal is never used"));
    }
    d.finish()?;
    Ok(StateImage {
        now_ms,
        next_fence,
        locks,
        sessions,
        recent_ends,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencelock_core::{Config, Core};

    fn name(s: &str) -> LockName {
        LockName::new(s).unwrap()
    }

    fn sample_commands() -> Vec<Command> {
        let session = SessionId::from_u128(77);
        vec![
            Command::OpenSession {
                id: session,
                ttl_ms: 5_000,
                owner: Owner::new("worker-1").unwrap(),
                tenant: Some(Tenant::new("worker").unwrap()),
                quota: Some(Quota {
                    max_sessions: 3,
                    max_held_locks: 40,
                    max_waiters: 5,
                }),
            },
            Command::Acquire(Acquire {
                name: name("a"),
                token: OwnerToken::from_u128(1),
                ttl_ms: Some(1_000),
                wait_ms: 0,
                owner: Owner::new("host:1").unwrap(),
                request_id: Some(RequestId::new("r1").unwrap()),
                limit: 1,
                lock_delay_ms: 50,
                session: None,
                tenant: None,
                quota: None,
                mode: Mode::Exclusive,
                value: None,
            }),
            Command::Acquire(Acquire {
                name: name("a"),
                token: OwnerToken::from_u128(2),
                ttl_ms: None,
                wait_ms: 3_000,
                owner: Owner::default(),
                request_id: None,
                limit: 1,
                lock_delay_ms: 0,
                session: Some(session),
                tenant: Some(Tenant::new("worker").unwrap()),
                quota: None,
                mode: Mode::Exclusive,
                value: None,
            }),
            Command::Renew {
                name: name("a"),
                token: OwnerToken::from_u128(1),
                ttl_ms: Some(2_000),
            },
            Command::KeepAlive { id: session },
            Command::Tick,
            Command::RaiseFenceFloor { floor: 10 },
            Command::ForceRelease {
                name: name("a"),
                fence: Fence::new(1),
                reason: Reason::new("stuck").unwrap(),
            },
            Command::CancelWait {
                name: name("a"),
                token: OwnerToken::from_u128(2),
            },
            Command::Release {
                name: name("a"),
                token: OwnerToken::from_u128(1),
            },
            Command::CloseSession { id: session },
            Command::Recover,
            Command::Acquire(Acquire {
                mode: Mode::Shared,
                ..kinds_acquire("r", 5)
            }),
            Command::Acquire(Acquire {
                value: Some(Value::new("host-1:8080").unwrap()),
                ..kinds_acquire("leader", 6)
            }),
            Command::AcquireAll(vec![
                kinds_acquire("x", 7),
                Acquire {
                    mode: Mode::Shared,
                    ..kinds_acquire("y", 8)
                },
            ]),
            Command::Downgrade {
                name: name("x"),
                token: OwnerToken::from_u128(7),
            },
            Command::Proclaim {
                name: name("leader"),
                token: OwnerToken::from_u128(6),
                value: Value::new("host-1:9090").unwrap(),
            },
            Command::ReleaseAll {
                grants: vec![
                    (name("x"), OwnerToken::from_u128(7)),
                    (name("y"), OwnerToken::from_u128(8)),
                ],
            },
        ]
    }

    fn kinds_acquire(lock: &str, token: u128) -> Acquire {
        Acquire {
            name: name(lock),
            token: OwnerToken::from_u128(token),
            ttl_ms: Some(1_000),
            wait_ms: 100,
            owner: Owner::new("k").unwrap(),
            request_id: Some(RequestId::new("k1").unwrap()),
            limit: 1,
            lock_delay_ms: 0,
            session: None,
            tenant: Some(Tenant::new("worker").unwrap()),
            quota: None,
            mode: Mode::Exclusive,
            value: None,
        }
    }

    /// Records written before modes, values and multi-locks (version 3) decode as
    /// exclusive acquires without a value; a version 3 record cannot carry the
    /// new commands.
    #[test]
    fn version_3_records_decode_as_exclusive_acquires() {
        let meta = RecordMeta {
            seq: 4,
            now_ms: 10,
            wall_ms: 2,
            actor: Some("worker".into()),
        };
        // Written by hand as version 3 laid an acquire out: no mode, no value.
        let mut v3 = vec![3u8];
        v3.extend_from_slice(&10u64.to_le_bytes());
        v3.extend_from_slice(&4u64.to_le_bytes());
        v3.extend_from_slice(&2u64.to_le_bytes());
        let mut e = Enc::default();
        e.opt_str(Some("worker"));
        e.u8(tag::ACQUIRE);
        e.str("a");
        e.u128(1);
        e.opt_u64(Some(1_000));
        e.u64(0);
        e.str("host:1");
        e.opt_str(None);
        e.u32(1);
        e.u64(0);
        e.opt_u128(None);
        e.opt_str(Some("worker"));
        e.u8(0);
        v3.extend_from_slice(&e.0);
        let (got_meta, command) = decode_record(&v3).unwrap();
        assert_eq!(got_meta, meta);
        assert_eq!(
            command,
            Command::Acquire(Acquire {
                name: name("a"),
                token: OwnerToken::from_u128(1),
                ttl_ms: Some(1_000),
                wait_ms: 0,
                owner: Owner::new("host:1").unwrap(),
                request_id: None,
                limit: 1,
                lock_delay_ms: 0,
                session: None,
                tenant: Some(Tenant::new("worker").unwrap()),
                quota: None,
                mode: Mode::Exclusive,
                value: None,
            })
        );
        // The same record in version 4 carries the mode and value after it.
        let v4 = encode_record(&meta, &command);
        assert_eq!(&v4[1..], [&v3[1..], &[0, 0][..]].concat());
        let downgrade = Command::Downgrade {
            name: name("a"),
            token: OwnerToken::from_u128(1),
        };
        let mut new_in_v3 = encode_record(&meta, &downgrade);
        new_in_v3[0] = 3;
        assert!(decode_record(&new_in_v3).is_err());
    }

    #[test]
    fn snapshots_carry_modes_values_and_multi_lock_groups() {
        let mut core = Core::new(Config::default());
        for (i, c) in sample_commands().into_iter().skip(12).take(3).enumerate() {
            core.apply(i as u64, c).unwrap();
        }
        // Queued behind the shared `y` part: a writer, then a multi-lock.
        core.apply(
            3,
            Command::AcquireAll(vec![
                Acquire {
                    request_id: None,
                    ..kinds_acquire("y", 20)
                },
                Acquire {
                    request_id: None,
                    ..kinds_acquire("r", 21)
                },
            ]),
        )
        .unwrap();
        let image = core.export();
        assert!(image
            .locks
            .iter()
            .any(|l| l.waiters.iter().any(|w| w.group.len() == 2)));
        assert!(image
            .locks
            .iter()
            .any(|l| l.holders.iter().any(|h| h.value.is_some())));
        assert_eq!(decode_snapshot(&encode_snapshot(&image)).unwrap(), image);
        // A version 2 snapshot decodes as exclusive, without values or groups.
        let v2 = decode_snapshot(&encode_snapshot_version(&image, SNAPSHOT_VERSION_2)).unwrap();
        assert!(v2.locks.iter().all(|l| l
            .holders
            .iter()
            .all(|h| h.mode == Mode::Exclusive && h.value.is_none())
            && l.waiters.iter().all(|w| w.group.is_empty())));
    }

    #[test]
    fn records_round_trip() {
        for (i, c) in sample_commands().into_iter().enumerate() {
            let meta = RecordMeta {
                seq: i as u64 + 1,
                now_ms: i as u64 * 7,
                wall_ms: 1_700_000_000_000 + i as u64,
                actor: (i % 2 == 0).then(|| format!("admin-{i}")),
            };
            let bytes = encode_record(&meta, &c);
            assert_eq!(decode_record(&bytes).unwrap(), (meta, c));
        }
    }

    /// A Raft entry holds a command record or an import; a single server's log
    /// never holds an import, so its decoder refuses one.
    #[test]
    fn replicated_records_are_commands_or_imports() {
        let meta = RecordMeta {
            seq: 0,
            now_ms: 12,
            wall_ms: 34,
            actor: Some("server".into()),
        };
        let command = encode_record(&meta, &Command::Promote);
        assert_eq!(
            decode_replicated(&command).unwrap(),
            Replicated::Command(meta.clone(), Command::Promote)
        );
        let image = encode_snapshot(&Core::new(Config::default()).export());
        let import = encode_import(&meta, &image);
        assert_eq!(
            decode_replicated(&import).unwrap(),
            Replicated::Import {
                meta: meta.clone(),
                snapshot: image.clone()
            }
        );
        assert!(decode_record(&import).is_err());
        // Cut anywhere, or with a byte more, it is refused.
        for cut in 0..import.len() {
            assert!(decode_replicated(&import[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = import.clone();
        longer.push(0);
        assert!(decode_replicated(&longer).is_err());
    }

    /// Records written before principals were recorded (version 2) decode with
    /// none: such sessions are owned by nobody.
    #[test]
    fn version_2_records_decode_without_principals() {
        let meta = RecordMeta {
            seq: 3,
            now_ms: 9,
            wall_ms: 1,
            actor: None,
        };
        for c in sample_commands() {
            let (with_none, had) = match c.clone() {
                Command::Acquire(a) => (
                    Command::Acquire(Acquire {
                        tenant: None,
                        quota: None,
                        mode: Mode::Exclusive,
                        value: None,
                        ..a
                    }),
                    true,
                ),
                Command::AcquireAll(_)
                | Command::Downgrade { .. }
                | Command::Proclaim { .. }
                | Command::ReleaseAll { .. } => continue,
                Command::OpenSession {
                    id, ttl_ms, owner, ..
                } => (
                    Command::OpenSession {
                        id,
                        ttl_ms,
                        owner,
                        tenant: None,
                        quota: None,
                    },
                    true,
                ),
                other => (other, false),
            };
            let mut v2 = encode_record(&meta, &with_none);
            v2[0] = 2;
            if matches!(with_none, Command::Acquire(_)) {
                // Version 4 appends the mode (exclusive) and an absent value.
                assert_eq!(v2.split_off(v2.len() - 2), [0, 0]);
            }
            if had {
                // Version 3 appends an absent principal and an absent quota.
                assert_eq!(v2.split_off(v2.len() - 2), [0, 0]);
            }
            assert_eq!(decode_record(&v2).unwrap(), (meta.clone(), with_none));
        }
    }

    #[test]
    fn version_1_records_still_decode_without_metadata() {
        // A record written before the audit log: version 1, now_ms, then the command.
        let mut v1 = vec![1u8];
        v1.extend_from_slice(&42u64.to_le_bytes());
        v1.push(9); // Tick
        let (meta, command) = decode_record(&v1).unwrap();
        assert_eq!(command, Command::Tick);
        assert_eq!(
            meta,
            RecordMeta {
                now_ms: 42,
                ..RecordMeta::default()
            }
        );
    }

    #[test]
    fn snapshots_round_trip_a_busy_state() {
        let mut core = Core::new(Config::default());
        let session = SessionId::from_u128(9);
        core.apply(
            0,
            Command::OpenSession {
                id: session,
                ttl_ms: 10_000,
                owner: Owner::new("s").unwrap(),
                tenant: Some(Tenant::new("worker").unwrap()),
                quota: None,
            },
        )
        .unwrap();
        for (i, c) in sample_commands().into_iter().take(4).enumerate() {
            let _ = core.apply(i as u64, c);
        }
        core.apply(
            5,
            Command::Acquire(Acquire {
                name: name("b"),
                token: OwnerToken::from_u128(3),
                ttl_ms: None,
                wait_ms: 0,
                owner: Owner::default(),
                request_id: None,
                limit: 2,
                lock_delay_ms: 0,
                session: Some(session),
                tenant: Some(Tenant::new("worker").unwrap()),
                quota: None,
                mode: Mode::Exclusive,
                value: None,
            }),
        )
        .unwrap();
        let image = core.export();
        let decoded = decode_snapshot(&encode_snapshot(&image)).unwrap();
        assert_eq!(decoded, image);
        assert!(!image.locks.is_empty());
        assert!(image
            .locks
            .iter()
            .any(|l| l.holders.iter().any(|h| h.tenant.is_some())));
        // A version 1 snapshot (before principals) decodes with none recorded.
        let mut old = image.clone();
        for s in &mut old.sessions {
            s.tenant = None;
        }
        for l in &mut old.locks {
            l.holders.iter_mut().for_each(|h| h.tenant = None);
            l.waiters.iter_mut().for_each(|w| w.tenant = None);
        }
        let v1 = encode_snapshot_version(&image, SNAPSHOT_VERSION_1);
        assert_eq!(decode_snapshot(&v1).unwrap(), old);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let meta = RecordMeta {
            seq: 3,
            now_ms: 5,
            wall_ms: 6,
            actor: Some("ops".into()),
        };
        let good = encode_record(&meta, &sample_commands()[1]);
        for cut in 0..good.len() {
            assert!(decode_record(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = good.clone();
        extra.push(0);
        assert!(decode_record(&extra).is_err());
        assert!(decode_snapshot(b"FLSNAP01\x01\xff\xff\xff\xff").is_err());
        assert!(decode_snapshot(b"nope").is_err());
        let image = Core::new(Config::default()).export();
        let mut snap = encode_snapshot(&image);
        *snap.last_mut().unwrap() = 0xff; // the high byte of the recent_ends count
        assert!(decode_snapshot(&snap).is_err());
    }
}
