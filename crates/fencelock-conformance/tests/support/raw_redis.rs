//! Looks at a Redis server directly (keys, counters, command statistics, clients),
//! independent of the backend under test: one blocking connection of the `redis`
//! crate per command.

// Each test binary uses a part of it.
#![allow(dead_code)]

use fencelock::redis::redis;

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

fn convert(value: redis::Value) -> Value {
    match value {
        redis::Value::Int(n) => Value::Int(n),
        redis::Value::Nil => Value::Text(None),
        redis::Value::Okay => Value::Text(Some("OK".to_owned())),
        redis::Value::SimpleString(text) => Value::Text(Some(text)),
        redis::Value::BulkString(bytes) => {
            Value::Text(Some(String::from_utf8(bytes).expect("UTF-8")))
        }
        redis::Value::VerbatimString { text, .. } => Value::Text(Some(text)),
        redis::Value::Array(items) | redis::Value::Set(items) => {
            Value::Array(items.into_iter().map(convert).collect())
        }
        other => panic!("unexpected reply {other:?}"),
    }
}

/// Runs one command on the server on 127.0.0.1:`port` and returns its reply.
pub fn command(port: u16, args: &[&str]) -> Value {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).expect("a redis url");
    let mut connection = client
        .get_connection_with_timeout(std::time::Duration::from_secs(10))
        .expect("connect to redis");
    let mut command = redis::cmd(args[0]);
    for arg in &args[1..] {
        command.arg(*arg);
    }
    match command.query::<redis::Value>(&mut connection) {
        Ok(value) => convert(value),
        Err(e) => Value::Error(e.to_string()),
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

/// The clients of type `kind` (`normal`, `pubsub`) connected now, as `CLIENT LIST`
/// lines, without the connection asking.
pub fn clients(port: u16, kind: &str) -> Vec<String> {
    let list = command(port, &["CLIENT", "LIST", "TYPE", kind]);
    let list = list.text().expect("CLIENT LIST answers text");
    list.lines()
        .filter(|line| !line.contains("cmd=client|list"))
        .map(str::to_owned)
        .collect()
}
