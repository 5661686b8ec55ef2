//! A blocking, minimal RESP2 client for tests to look at a Redis server directly
//! (keys, counters, command statistics), independent of the backend under test.

// Each test binary uses a part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A reply, as far as the tests need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Int(i64),
    Text(Option<String>),
    Array(Vec<Value>),
    Error(String),
}

impl Value {
    /// The text of a string reply (`None` for nil or other kinds).
    pub fn text(&self) -> Option<&str> {
        match self {
            Value::Text(Some(text)) => Some(text),
            _ => None,
        }
    }
}

/// Runs one command on the server on 127.0.0.1:`port` and returns its reply.
pub fn command(port: u16, args: &[&str]) -> Value {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to redis");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let mut out = format!("*{}\r\n", args.len());
    for arg in args {
        out.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    stream.write_all(out.as_bytes()).expect("send a command");
    read(&mut BufReader::new(stream))
}

fn read(reader: &mut BufReader<TcpStream>) -> Value {
    let mut line = String::new();
    reader.read_line(&mut line).expect("read a reply");
    let line = line.trim_end_matches("\r\n");
    let (kind, rest) = line.split_at(1);
    match kind {
        "+" => Value::Text(Some(rest.to_owned())),
        "-" => Value::Error(rest.to_owned()),
        ":" => Value::Int(rest.parse().expect("an integer")),
        "$" => {
            let len: i64 = rest.parse().expect("a length");
            if len < 0 {
                return Value::Text(None);
            }
            let mut data = vec![0; len as usize + 2];
            reader.read_exact(&mut data).expect("a string");
            data.truncate(len as usize);
            Value::Text(Some(String::from_utf8(data).expect("UTF-8")))
        }
        "*" => {
            let len: i64 = rest.parse().expect("a length");
            Value::Array((0..len.max(0)).map(|_| read(reader)).collect())
        }
        _ => panic!("unexpected reply {line:?}"),
    }
}

/// How many times `EVALSHA` ran on the server (from `INFO commandstats`).
pub fn evalsha_calls(port: u16) -> u64 {
    let info = command(port, &["INFO", "commandstats"]);
    let info = info.text().expect("INFO answers text");
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map(|n| n.parse().expect("a count"))
        .unwrap_or(0)
}

/// Whether `key` exists.
pub fn exists(port: u16, key: &str) -> bool {
    command(port, &["EXISTS", key]) == Value::Int(1)
}
