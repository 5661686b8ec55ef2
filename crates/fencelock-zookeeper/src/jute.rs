//! The ZooKeeper wire format (jute): big-endian `int`s and `long`s, strings and byte
//! buffers prefixed by an `int` length (-1 = null), vectors prefixed by an `int` count.
//! Only the records the lock recipe needs.

/// Request opcodes (`ZooDefs.OpCode`).
pub(super) mod op {
    pub const DELETE: i32 = 2;
    pub const EXISTS: i32 = 3;
    pub const GET_DATA: i32 = 4;
    pub const GET_CHILDREN: i32 = 8;
    pub const PING: i32 = 11;
    pub const CREATE2: i32 = 15;
    pub const CREATE_CONTAINER: i32 = 19;
    pub const CLOSE_SESSION: i32 = -11;
}

/// Reserved reply xids.
pub(super) mod xid {
    /// A watch notification.
    pub const WATCH: i32 = -1;
    /// The answer to a ping.
    pub const PING: i32 = -2;
    /// The answer to an authentication packet.
    pub const AUTH: i32 = -4;
    /// The answer to a SetWatches packet.
    pub const SET_WATCHES: i32 = -8;
}

/// Reply error codes (`KeeperException.Code`).
pub(super) mod code {
    pub const OK: i32 = 0;
    pub const CONNECTION_LOSS: i32 = -4;
    pub const OPERATION_TIMEOUT: i32 = -7;
    pub const BAD_ARGUMENTS: i32 = -8;
    pub const NEW_CONFIG_NO_QUORUM: i32 = -13;
    pub const NO_NODE: i32 = -101;
    pub const NO_AUTH: i32 = -102;
    pub const NODE_EXISTS: i32 = -110;
    pub const SESSION_EXPIRED: i32 = -112;
    pub const INVALID_ACL: i32 = -114;
    pub const AUTH_FAILED: i32 = -115;
    pub const SESSION_MOVED: i32 = -118;
    pub const NOT_READ_ONLY: i32 = -119;
    pub const THROTTLED: i32 = -127;
}

/// Node creation modes (`CreateMode`).
pub(super) mod mode {
    pub const PERSISTENT: i32 = 0;
    pub const EPHEMERAL_SEQUENTIAL: i32 = 3;
    pub const CONTAINER: i32 = 4;
}

/// The largest frame accepted from the server (ZooKeeper's own `jute.maxbuffer`
/// default is 1 MiB; a long waiter list can exceed it only if the server allows).
pub(super) const MAX_FRAME_BYTES: usize = 16 << 20;

/// A malformed or truncated record.
#[derive(Debug, Clone)]
pub(super) struct Malformed(pub &'static str);

/// Serializes a record.
#[derive(Debug, Default)]
pub(super) struct Writer(pub Vec<u8>);

impl Writer {
    pub fn int(&mut self, v: i32) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub fn long(&mut self, v: i64) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.0.push(u8::from(v));
        self
    }

    pub fn buffer(&mut self, v: &[u8]) -> &mut Self {
        // Every buffer and string this client sends is far below 2 GiB.
        self.int(i32::try_from(v.len()).unwrap_or(i32::MAX));
        self.0.extend_from_slice(v);
        self
    }

    pub fn string(&mut self, v: &str) -> &mut Self {
        self.buffer(v.as_bytes())
    }
}

/// Deserializes a record.
#[derive(Debug)]
pub(super) struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed("truncated record"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    pub fn int(&mut self) -> Result<i32, Malformed> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn long(&mut self) -> Result<i64, Malformed> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(i64::from_be_bytes(a))
    }

    pub fn buffer(&mut self) -> Result<&'a [u8], Malformed> {
        let len = self.int()?;
        if len < 0 {
            return Ok(&[]);
        }
        self.take(len as usize)
    }

    pub fn string(&mut self) -> Result<String, Malformed> {
        let bytes = self.buffer()?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Malformed("string is not UTF-8"))
    }

    /// A vector of strings (`getChildren`), its length bounded by the frame.
    pub fn strings(&mut self) -> Result<Vec<String>, Malformed> {
        let count = self.int()?;
        // Each string takes at least its 4-byte length: a count the frame cannot
        // hold is malformed, not an allocation to attempt.
        if count < 0 || count as usize > self.0.len() / 4 {
            return Err(Malformed("bad vector length"));
        }
        (0..count).map(|_| self.string()).collect()
    }

    pub fn stat(&mut self) -> Result<Stat, Malformed> {
        let czxid = self.long()?;
        let _mzxid = self.long()?;
        let _ctime = self.long()?;
        let _mtime = self.long()?;
        let _version = self.int()?;
        let _cversion = self.int()?;
        let _aversion = self.int()?;
        let ephemeral_owner = self.long()?;
        let _data_length = self.int()?;
        let _num_children = self.int()?;
        let _pzxid = self.long()?;
        Ok(Stat {
            czxid,
            ephemeral_owner,
        })
    }
}

/// The parts of a node's `Stat` the recipe reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stat {
    /// The zxid of the transaction that created the node.
    pub czxid: i64,
    /// The session owning an ephemeral node (0 for a persistent one).
    pub ephemeral_owner: i64,
}

/// `CreateRequest`: no data, the open ACL (the lock tree is not secret; see the
/// module docs), `mode`.
pub(super) fn create(path: &str, mode: i32) -> Vec<u8> {
    let mut w = Writer::default();
    w.string(path).buffer(&[]);
    w.int(1).int(31).string("world").string("anyone");
    w.int(mode);
    w.0
}

/// `ExistsRequest`, `GetDataRequest` and `GetChildrenRequest`: a path and a watch flag.
pub(super) fn path_watch(path: &str, watch: bool) -> Vec<u8> {
    let mut w = Writer::default();
    w.string(path).bool(watch);
    w.0
}

/// `DeleteRequest` for any version.
pub(super) fn delete(path: &str) -> Vec<u8> {
    let mut w = Writer::default();
    w.string(path).int(-1);
    w.0
}

/// `ConnectRequest` as a length-prefixed frame.
pub(super) fn connect_frame(
    last_zxid: i64,
    timeout_ms: i32,
    session_id: i64,
    password: &[u8],
) -> Vec<u8> {
    let mut body = Writer::default();
    body.int(0).long(last_zxid).int(timeout_ms).long(session_id);
    body.buffer(password).bool(false);
    let mut frame = Writer::default();
    frame.buffer(&body.0);
    frame.0
}

/// A request frame: length, xid, opcode, body.
pub(super) fn request_frame(xid: i32, op: i32, body: &[u8]) -> Vec<u8> {
    let mut frame = Writer(Vec::with_capacity(12 + body.len()));
    frame.int(i32::try_from(8 + body.len()).unwrap_or(i32::MAX));
    frame.int(xid).int(op);
    frame.0.extend_from_slice(body);
    frame.0
}

/// The name of an error code, for messages.
pub(super) fn code_name(err: i32) -> String {
    let name = match err {
        code::CONNECTION_LOSS => "ConnectionLoss",
        code::OPERATION_TIMEOUT => "OperationTimeout",
        code::BAD_ARGUMENTS => "BadArguments",
        code::NEW_CONFIG_NO_QUORUM => "NewConfigNoQuorum",
        code::NO_NODE => "NoNode",
        code::NO_AUTH => "NoAuth",
        code::NODE_EXISTS => "NodeExists",
        code::SESSION_EXPIRED => "SessionExpired",
        code::INVALID_ACL => "InvalidACL",
        code::AUTH_FAILED => "AuthFailed",
        code::SESSION_MOVED => "SessionMoved",
        code::NOT_READ_ONLY => "NotReadOnly",
        code::THROTTLED => "Throttled",
        _ => return format!("error {err}"),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let mut w = Writer::default();
        w.int(-7).long(1 << 40).string("/a/b").bool(true);
        let mut r = Reader(&w.0);
        assert_eq!(r.int().unwrap(), -7);
        assert_eq!(r.long().unwrap(), 1 << 40);
        assert_eq!(r.string().unwrap(), "/a/b");
        assert!(r.int().is_err(), "a bool is one byte, not an int");
    }

    #[test]
    fn truncated_and_oversized_records_are_malformed() {
        assert!(Reader(&[0, 0, 0, 9, b'a']).string().is_err());
        // A vector claiming more entries than the frame can hold.
        assert!(Reader(&[0x7f, 0xff, 0xff, 0xff]).strings().is_err());
        assert!(Reader(&[0, 0, 0]).int().is_err());
    }
}
