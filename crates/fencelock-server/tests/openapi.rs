//! The OpenAPI document (`GET /v1/openapi.json`) against the router and against real
//! answers, so it cannot drift from what the server does:
//!
//! - every `/v1` route the router's source registers (and `/healthz`, `/readyz`,
//!   `/metrics`) is an operation of the document, and every operation of the document
//!   is served: a handler added without its `#[utoipa::path]` fails here;
//! - real answers of every operation, successes and errors, are checked against the
//!   schema the document gives for their status, with a small checker of the subset
//!   of JSON Schema utoipa emits. The checker refuses any keyword it does not know,
//!   and is stricter than the schemas in one way: an answer may carry no property its
//!   schema does not list (a field added without its type changing cannot happen, but
//!   a hand-written body could).

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use fencelock_server::cluster::ClusterConfig;
use fencelock_server::{AuthConfig, Role, TokenConfig};
use serde_json::{json, Value};
use support::{Client, Response, TestServer};

/// A small validator of the JSON Schema subset utoipa emits (draft 2020-12, as
/// OpenAPI 3.1 uses it). Returns the first mismatch, with the JSON path.
mod checker {
    use serde_json::Value;

    /// Annotations: no effect on validity.
    const ANNOTATIONS: [&str; 7] = [
        "description",
        "title",
        "default",
        "example",
        "examples",
        "deprecated",
        "format",
    ];

    /// Validates `value` against `schema` (which may be a `$ref` into `doc`). A
    /// property that no schema declares is refused (stricter than JSON Schema, so an
    /// undocumented field fails).
    pub fn validate(doc: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
        validate_as(doc, schema, value, at, true)
    }

    /// The property names `schema` declares, through `$ref`s and `allOf` parts (a
    /// flattened struct is an `allOf` of its parts).
    fn declared(doc: &Value, schema: &Value, out: &mut Vec<String>) -> Result<(), String> {
        if let Some(reference) = schema.get("$ref") {
            declared(doc, resolve(doc, reference)?, out)?;
        }
        if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
            out.extend(properties.keys().cloned());
        }
        for part in schema
            .get("allOf")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            declared(doc, part, out)?;
        }
        Ok(())
    }

    /// [`validate`]; `strict: false` inside an `allOf` part, whose siblings may
    /// declare the properties it does not (the `allOf` checks the union).
    fn validate_as(
        doc: &Value,
        schema: &Value,
        value: &Value,
        at: &str,
        strict: bool,
    ) -> Result<(), String> {
        let Some(schema) = schema.as_object() else {
            return match schema {
                Value::Bool(true) => Ok(()),
                _ => Err(format!("{at}: schema {schema} is not an object")),
            };
        };
        for key in schema.keys() {
            let known = ANNOTATIONS.contains(&key.as_str())
                || [
                    "$ref",
                    "type",
                    "properties",
                    "required",
                    "additionalProperties",
                    "items",
                    "enum",
                    "const",
                    "oneOf",
                    "anyOf",
                    "allOf",
                    "minimum",
                    "maximum",
                ]
                .contains(&key.as_str());
            if !known {
                return Err(format!(
                    "{at}: the checker does not know the keyword {key:?}"
                ));
            }
        }
        if let Some(reference) = schema.get("$ref") {
            let target = resolve(doc, reference)?;
            validate_as(doc, target, value, at, strict)?;
        }
        if let Some(types) = schema.get("type") {
            let types: Vec<&str> = match types {
                Value::String(t) => vec![t.as_str()],
                Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
                other => return Err(format!("{at}: bad type {other}")),
            };
            if !types.iter().any(|t| has_type(value, t)) {
                return Err(format!("{at}: {value} is not of type {types:?}"));
            }
        }
        if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
            if !allowed.contains(value) {
                return Err(format!("{at}: {value} is not one of {allowed:?}"));
            }
        }
        if let Some(constant) = schema.get("const") {
            if constant != value {
                return Err(format!("{at}: {value} is not {constant}"));
            }
        }
        if let (Some(min), Some(n)) = (
            schema.get("minimum").and_then(Value::as_f64),
            value.as_f64(),
        ) {
            if n < min {
                return Err(format!("{at}: {n} is below the minimum {min}"));
            }
        }
        if let (Some(max), Some(n)) = (
            schema.get("maximum").and_then(Value::as_f64),
            value.as_f64(),
        ) {
            if n > max {
                return Err(format!("{at}: {n} is above the maximum {max}"));
            }
        }
        if let Some(all) = schema.get("allOf").and_then(Value::as_array) {
            for s in all {
                validate_as(doc, s, value, at, false)?;
            }
            if let (true, Value::Object(fields)) = (strict, value) {
                let mut names = Vec::new();
                declared(doc, &Value::Object(schema.clone()), &mut names)?;
                if let Some(name) = fields.keys().find(|name| !names.contains(name)) {
                    return Err(format!(
                        "{at}: the property {name:?} is not in the document"
                    ));
                }
            }
        }
        if let Some(one) = schema.get("oneOf").and_then(Value::as_array) {
            let matching = one
                .iter()
                .filter(|s| validate(doc, s, value, at).is_ok())
                .count();
            if matching != 1 {
                return Err(format!(
                    "{at}: {value} matches {matching} of the oneOf schemas, not exactly one"
                ));
            }
        }
        if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
            if !any.iter().any(|s| validate(doc, s, value, at).is_ok()) {
                return Err(format!("{at}: {value} matches none of the anyOf schemas"));
            }
        }
        if let Value::Object(fields) = value {
            let properties = schema.get("properties").and_then(Value::as_object);
            if let Some(required) = schema.get("required").and_then(Value::as_array) {
                for name in required.iter().filter_map(Value::as_str) {
                    if !fields.contains_key(name) {
                        return Err(format!("{at}: the required property {name:?} is missing"));
                    }
                }
            }
            if let Some(properties) = properties {
                for (name, v) in fields {
                    match properties.get(name) {
                        Some(s) => validate(doc, s, v, &format!("{at}.{name}"))?,
                        None => match schema.get("additionalProperties") {
                            Some(Value::Bool(true)) => {}
                            Some(s @ Value::Object(_)) => {
                                validate(doc, s, v, &format!("{at}.{name}"))?
                            }
                            _ if !strict => {}
                            _ => {
                                return Err(format!(
                                    "{at}: the property {name:?} is not in the document"
                                ))
                            }
                        },
                    }
                }
            }
        }
        if let (Value::Array(items), Some(item_schema)) = (value, schema.get("items")) {
            for (i, item) in items.iter().enumerate() {
                validate(doc, item_schema, item, &format!("{at}[{i}]"))?;
            }
        }
        Ok(())
    }

    fn has_type(value: &Value, t: &str) -> bool {
        match t {
            "null" => value.is_null(),
            "boolean" => value.is_boolean(),
            "string" => value.is_string(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            "array" => value.is_array(),
            "object" => value.is_object(),
            _ => false,
        }
    }

    /// A local `$ref` (`#/components/schemas/Name`).
    pub fn resolve<'a>(doc: &'a Value, reference: &Value) -> Result<&'a Value, String> {
        let pointer = reference
            .as_str()
            .and_then(|r| r.strip_prefix('#'))
            .ok_or_else(|| format!("not a local $ref: {reference}"))?;
        doc.pointer(pointer)
            .ok_or_else(|| format!("$ref {pointer} names nothing in the document"))
    }
}

/// The operations of the document, as `"METHOD /path"`.
fn documented(doc: &Value) -> BTreeSet<String> {
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in ["get", "post", "put", "patch", "delete"] {
            if item.get(method).is_some() {
                ops.insert(format!("{} {path}", method.to_uppercase()));
            }
        }
    }
    ops
}

/// The routes the server's source registers with `.route("PATH", METHOD(handler)…)`,
/// as `"METHOD /path"` (axum's `{*name}` written `{name}`, as OpenAPI has it): the
/// client API's (`/v1/…`) and the probes, not the dashboard's pages or the peer port.
fn routed() -> BTreeSet<String> {
    let mut routes = BTreeSet::new();
    let mut files = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            for entry in std::fs::read_dir(&path).expect("read src") {
                files.push(entry.expect("dir entry").path());
            }
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let source = std::fs::read_to_string(&path).expect("read a source file");
        for (start, _) in source.match_indices(".route(") {
            let call = &source[start + ".route(".len()..];
            let Some(literal) = call.trim_start().strip_prefix('"') else {
                continue;
            };
            let Some((route, rest)) = literal.split_once('"') else {
                continue;
            };
            // The arguments up to the call's closing parenthesis.
            let mut depth = 1;
            let end = rest
                .char_indices()
                .find(|(_, c)| {
                    match c {
                        '(' => depth += 1,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    depth == 0
                })
                .map_or(rest.len(), |(i, _)| i);
            let handlers = &rest[..end];
            let path = route.replace("{*", "{");
            if !(path.starts_with("/v1/") || ["/healthz", "/readyz", "/metrics"].contains(&&*path))
            {
                continue;
            }
            for method in ["get", "post", "put", "patch", "delete"] {
                let called = handlers.match_indices(&format!("{method}(")).any(|(i, _)| {
                    i == 0
                        || !handlers.as_bytes()[i - 1].is_ascii_alphanumeric()
                            && handlers.as_bytes()[i - 1] != b'_'
                });
                if called {
                    routes.insert(format!("{} {path}", method.to_uppercase()));
                }
            }
        }
    }
    routes
}

/// The routes in `routes` that `doc` does not describe.
fn missing(routes: &BTreeSet<String>, doc: &Value) -> Vec<String> {
    routes.difference(&documented(doc)).cloned().collect()
}

async fn fetch_document(c: &Client) -> Value {
    let r = c.get("/v1/openapi.json").await;
    assert_eq!(r.header("content-type"), Some("application/json"));
    let doc = r.expect_json(200);
    assert_eq!(
        doc["openapi"].as_str().map(|v| &v[..2]),
        Some("3."),
        "{doc}"
    );
    doc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_of_the_router_is_in_the_document_and_served() {
    let s = TestServer::start().await;
    let doc = fetch_document(&s.client).await;
    let routes = routed();
    // The scan itself finds routes of every module that has them.
    for sure in [
        "POST /v1/acquire",
        "GET /v1/locks/{name}",
        "DELETE /v1/sessions/{id}",
        "GET /v1/audit",
        "POST /v1/cluster/members",
        "GET /v1/openapi.json",
        "GET /healthz",
    ] {
        assert!(routes.contains(sure), "the scan missed {sure}: {routes:?}");
    }
    assert_eq!(
        missing(&routes, &doc),
        Vec::<String>::new(),
        "routes without a #[utoipa::path] in crate::openapi::ApiDoc"
    );

    // The planted mismatch: a document without one route's annotation is caught.
    let mut planted = doc.clone();
    planted["paths"]
        .as_object_mut()
        .unwrap()
        .remove("/v1/renew");
    assert_eq!(missing(&routes, &planted), ["POST /v1/renew"]);

    // And nothing is documented that the server does not serve.
    for op in documented(&doc) {
        let (method, path) = op.split_once(' ').unwrap();
        // An event stream never ends: ask it something it refuses.
        let concrete = match op.as_str() {
            "GET /v1/watch" => "/v1/watch?after=x".to_owned(),
            _ => path.replace(['{', '}'], ""),
        };
        // No body on a GET or DELETE: a handler that reads none leaves it unread,
        // and closing a connection with unread bytes resets it (RST), which can
        // overtake a large answer such as this document.
        let body: &[u8] = match method {
            "GET" | "DELETE" => b"",
            _ => b"{}",
        };
        let r = s
            .client
            .request(
                method,
                &concrete,
                &[("Content-Type", "application/json")],
                body,
            )
            .await;
        let unrouted = (r.status == 404 && r.text().contains("no such route")) || r.status == 405;
        assert!(!unrouted, "{op} is documented but not served: {}", r.text());
    }
    s.stop().await;
}

/// Validates answers against the document and remembers which operations answered
/// with a success and with an error.
struct Checked {
    doc: Value,
    successes: BTreeSet<String>,
    errors: BTreeSet<String>,
}

impl Checked {
    fn new(doc: Value) -> Checked {
        Checked {
            doc,
            successes: BTreeSet::new(),
            errors: BTreeSet::new(),
        }
    }

    /// Checks `r`, the answer to `method template`, against the document.
    fn check(&mut self, method: &str, template: &str, r: &Response) -> Value {
        let op = format!("{method} {template}");
        if let Err(e) = answer_matches(&self.doc, method, template, r) {
            panic!(
                "{op} answered {} against the document: {e}\nbody: {}",
                r.status,
                r.text()
            );
        }
        if r.status < 300 {
            self.successes.insert(op);
        } else {
            self.errors.insert(op);
        }
        serde_json::from_slice(&r.body).unwrap_or(Value::Null)
    }
}

/// Whether `r` is an answer the document allows for `method template`.
fn answer_matches(doc: &Value, method: &str, template: &str, r: &Response) -> Result<(), String> {
    let operation = doc["paths"][template]
        .get(method.to_lowercase())
        .ok_or("the operation is not in the document")?;
    let response = operation["responses"]
        .get(r.status.to_string())
        .ok_or_else(|| format!("status {} is not documented", r.status))?;
    let response = match response.get("$ref") {
        Some(reference) => checker::resolve(doc, reference)?,
        None => response,
    };
    let content_type = r.header("content-type").unwrap_or("");
    let media = content_type.split(';').next().unwrap_or("").trim();
    let content = response["content"]
        .get(media)
        .ok_or_else(|| format!("content type {content_type:?} is not documented"))?;
    if media != "application/json" {
        return Ok(());
    }
    let body: Value = serde_json::from_slice(&r.body).map_err(|e| format!("not JSON: {e}"))?;
    let schema = content.get("schema").ok_or("no schema")?;
    checker::validate(doc, schema, &body, "$")
}

const ADMIN: &str = "admin-secret-for-openapi";
const READER: &str = "reader-secret-for-openapi";

fn token(name: &str, role: Role, prefixes: &[&str], secret: &str) -> TokenConfig {
    TokenConfig {
        name: name.to_owned(),
        role,
        prefixes: prefixes.iter().map(|p| (*p).to_owned()).collect(),
        sha256: fencelock_server::auth::hash_token(secret),
        acquire_rate: None,
        request_rate: None,
        quotas: Default::default(),
    }
}

fn free_port() -> SocketAddr {
    let port = fencelock_testkit::free_port().expect("a free port");
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A one-member cluster (it elects itself): the `/v1/cluster` routes' successes.
async fn one_member_cluster() -> TestServer {
    let peer = free_port();
    let listen = free_port();
    let server = TestServer::start_configured(move |c| {
        c.listen = listen;
        c.engine.cluster = Some(ClusterConfig {
            node_id: 1,
            peer_listen: peer,
            peers: BTreeMap::from([(1, peer)]),
            join: false,
            advertise_url: String::new(),
            secret: Some("a-cluster-secret-for-openapi".into()),
            tls: None,
            heartbeat: Duration::from_millis(50),
            dial: BTreeMap::new(),
            leader_probe: true,
        });
    })
    .await;
    let client = server.client;
    support::poll_until(
        "the member leads",
        Duration::from_secs(30),
        move || async move {
            let v = client.get("/v1/cluster").await.json();
            (v["role"] == "leader").then_some(())
        },
    )
    .await;
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_answers_of_every_operation_match_the_document() {
    let s = TestServer::start().await;
    let c = s.client;
    let mut k = Checked::new(fetch_document(&c).await);

    // Locks: take, renew, read, release, and each one's refusals.
    let g = k.check(
        "POST",
        "/v1/acquire",
        &c.post(
            "/v1/acquire",
            &json!({"name": "doc:a", "ttl_ms": 30_000, "owner": "me"}),
        )
        .await,
    );
    let owner_token = g["owner_token"].as_str().unwrap().to_owned();
    for bad in [
        json!({"name": "doc:a", "ttl_ms": 30_000}),
        json!({"ttl_ms": 30_000}),
        json!({"name": "doc:a", "ttl_ms": "soon"}),
        json!({"name": "doc:b", "ttl_ms": 30_000, "session": "0".repeat(32)}),
    ] {
        let r = c.post("/v1/acquire", &bad).await;
        assert!(r.status >= 400, "{bad}: {}", r.text());
        k.check("POST", "/v1/acquire", &r);
    }
    let renew = json!({"name": "doc:a", "owner_token": owner_token, "ttl_ms": 20_000});
    k.check("POST", "/v1/renew", &c.post("/v1/renew", &renew).await);
    let wrong = json!({"name": "doc:a", "owner_token": "1".repeat(32)});
    k.check("POST", "/v1/renew", &c.post("/v1/renew", &wrong).await);
    k.check("GET", "/v1/locks/{name}", &c.get("/v1/locks/doc:a").await);
    k.check(
        "GET",
        "/v1/locks/{name}",
        &c.get("/v1/locks/doc:nobody").await,
    );
    k.check(
        "GET",
        "/v1/locks",
        &c.get("/v1/locks?prefix=doc:&limit=1").await,
    );
    k.check("GET", "/v1/locks", &c.get("/v1/locks?limit=0").await);
    let release = json!({"name": "doc:a", "owner_token": owner_token});
    k.check(
        "POST",
        "/v1/release",
        &c.post("/v1/release", &release).await,
    );
    let again = k.check(
        "POST",
        "/v1/release",
        &c.post("/v1/release", &release).await,
    );
    assert_eq!(again["reason"], "already_released");
    k.check("POST", "/v1/release", &c.post("/v1/release", &wrong).await);

    // Lock kinds: a multi-lock and its release together, a downgrade, an election.
    let all = k.check(
        "POST",
        "/v1/acquire",
        &c.post(
            "/v1/acquire",
            &json!({"names": ["doc:m1", "doc:m2"], "ttl_ms": 30_000, "mode": "shared"}),
        )
        .await,
    );
    let refs: Vec<Value> = all["grants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| json!({"name": g["name"], "owner_token": g["owner_token"]}))
        .collect();
    let both = c.post("/v1/release", &json!({ "grants": refs })).await;
    assert_eq!(
        k.check("POST", "/v1/release", &both)["released"],
        json!([true, true])
    );
    let w = k.check(
        "POST",
        "/v1/acquire",
        &c.post("/v1/acquire", &json!({"name": "doc:w", "ttl_ms": 30_000}))
            .await,
    );
    let down = json!({"name": "doc:w", "owner_token": w["owner_token"]});
    k.check(
        "POST",
        "/v1/downgrade",
        &c.post("/v1/downgrade", &down).await,
    );
    let stranger = json!({"name": "doc:w", "owner_token": "3".repeat(32)});
    k.check(
        "POST",
        "/v1/downgrade",
        &c.post("/v1/downgrade", &stranger).await,
    );
    let campaign = "/v1/elections/{name}/campaign";
    let lead = k.check(
        "POST",
        campaign,
        &c.post(
            "/v1/elections/doc:e/campaign",
            &json!({"value": "v1", "ttl_ms": 30_000}),
        )
        .await,
    );
    let rival = json!({"value": "v2", "ttl_ms": 30_000});
    let held = c.post("/v1/elections/doc:e/campaign", &rival).await;
    k.check("POST", campaign, &held);
    let proclaim = "/v1/elections/{name}/proclaim";
    let leader_token = lead["owner_token"].clone();
    let new_value = json!({"owner_token": leader_token, "value": "v3"});
    let r = c.post("/v1/elections/doc:e/proclaim", &new_value).await;
    k.check("POST", proclaim, &r);
    let not_leader = json!({"owner_token": "3".repeat(32), "value": "v"});
    let r = c.post("/v1/elections/doc:e/proclaim", &not_leader).await;
    k.check("POST", proclaim, &r);
    let led = k.check(
        "GET",
        "/v1/elections/{name}",
        &c.get("/v1/elections/doc:e").await,
    );
    assert_eq!(led["leader"]["value"], "v3");
    k.check(
        "GET",
        "/v1/elections/{name}",
        &c.get("/v1/elections/a%01b").await,
    );
    let resign = "/v1/elections/{name}/resign";
    let r = c
        .post(
            "/v1/elections/doc:e/resign",
            &json!({ "owner_token": leader_token }),
        )
        .await;
    k.check("POST", resign, &r);
    let r = c.post("/v1/elections/doc:e/resign", &json!({})).await;
    k.check("POST", resign, &r);
    let nobody = k.check(
        "GET",
        "/v1/elections/{name}",
        &c.get("/v1/elections/doc:e").await,
    );
    assert_eq!(nobody, json!({"leader": null}));

    // Sessions.
    let session = k.check(
        "POST",
        "/v1/sessions",
        &c.post("/v1/sessions", &json!({"ttl_ms": 30_000, "owner": "me"}))
            .await,
    );
    let id = session["session"].as_str().unwrap().to_owned();
    let handle = session["handle"].as_str().unwrap().to_owned();
    k.check(
        "POST",
        "/v1/sessions",
        &c.post("/v1/sessions", &json!({})).await,
    );
    let held = json!({"name": "doc:s", "session": id});
    k.check("POST", "/v1/acquire", &c.post("/v1/acquire", &held).await);
    k.check("GET", "/v1/locks/{name}", &c.get("/v1/locks/doc:s").await);
    let keepalive = format!("/v1/sessions/{id}/keepalive");
    k.check(
        "POST",
        "/v1/sessions/{id}/keepalive",
        &c.post(&keepalive, &json!({})).await,
    );
    let nobody = "2".repeat(32);
    let r = c
        .post(&format!("/v1/sessions/{nobody}/keepalive"), &json!({}))
        .await;
    k.check("POST", "/v1/sessions/{id}/keepalive", &r);
    k.check(
        "GET",
        "/v1/admin/sessions",
        &c.get("/v1/admin/sessions?prefix=doc:").await,
    );
    k.check(
        "GET",
        "/v1/admin/sessions",
        &c.get("/v1/admin/sessions?limit=0").await,
    );
    k.check(
        "DELETE",
        "/v1/sessions/{id}",
        &c.delete(&format!("/v1/sessions/{id}")).await,
    );
    k.check(
        "DELETE",
        "/v1/sessions/{id}",
        &c.delete(&format!("/v1/sessions/{id}")).await,
    );
    let second = c
        .post("/v1/sessions", &json!({"ttl_ms": 30_000}))
        .await
        .json();
    let second = second["handle"].as_str().unwrap().to_owned();
    let by_handle = format!("/v1/admin/sessions/{second}");
    k.check(
        "DELETE",
        "/v1/admin/sessions/{handle}",
        &c.delete(&by_handle).await,
    );
    let gone = format!("/v1/admin/sessions/{handle}");
    k.check(
        "DELETE",
        "/v1/admin/sessions/{handle}",
        &c.delete(&gone).await,
    );

    // Admin and audit.
    c.post("/v1/acquire", &json!({"name": "doc:f", "ttl_ms": 30_000}))
        .await
        .expect_json(200);
    let force = json!({"name": "doc:f", "reason": "the schema test"});
    k.check(
        "POST",
        "/v1/admin/force-release",
        &c.post("/v1/admin/force-release", &force).await,
    );
    k.check(
        "POST",
        "/v1/admin/force-release",
        &c.post("/v1/admin/force-release", &force).await,
    );
    k.check(
        "GET",
        "/v1/admin/snapshot",
        &c.get("/v1/admin/snapshot").await,
    );
    let audit = k.check(
        "GET",
        "/v1/audit",
        &c.get("/v1/audit?lock=doc:f&since_ms=0").await,
    );
    assert!(!audit["entries"].as_array().unwrap().is_empty(), "{audit}");
    k.check(
        "GET",
        "/v1/audit",
        &c.get("/v1/audit?since_ms=yesterday").await,
    );
    k.check("GET", "/v1/watch", &c.get("/v1/watch?after=x").await);
    k.check("GET", "/v1/watch", &c.get("/v1/watch?after=999999.0").await);

    // Probes, metrics, this document; the cluster routes' refusals on a single server.
    k.check("GET", "/healthz", &c.get("/healthz").await);
    k.check("GET", "/readyz", &c.get("/readyz").await);
    k.check("GET", "/metrics", &c.get("/metrics").await);
    k.check("GET", "/v1/openapi.json", &c.get("/v1/openapi.json").await);
    k.check("GET", "/v1/cluster", &c.get("/v1/cluster").await);
    let member = json!({"id": 2, "peer_addr": "127.0.0.1:1", "url": "http://127.0.0.1:2"});
    k.check(
        "POST",
        "/v1/cluster/members",
        &c.post("/v1/cluster/members", &member).await,
    );
    k.check(
        "DELETE",
        "/v1/cluster/members/{id}",
        &c.delete("/v1/cluster/members/2").await,
    );
    let transfer = json!({"id": 1});
    k.check(
        "POST",
        "/v1/cluster/transfer-leader",
        &c.post("/v1/cluster/transfer-leader", &transfer).await,
    );
    // A body too large, and a method the route does not take.
    let big = vec![b' '; 70 * 1024];
    let r = c
        .request(
            "POST",
            "/v1/acquire",
            &[("Content-Type", "application/json")],
            &big,
        )
        .await;
    k.check("POST", "/v1/acquire", &r);
    s.stop().await;

    // Authentication: 401 and 403 in the documented shape.
    let secure = TestServer::start_configured(|c| {
        c.auth = AuthConfig {
            tokens: vec![
                token("admin", Role::Admin, &[""], ADMIN),
                token("reader", Role::Reader, &["doc:"], READER),
            ],
        };
    })
    .await;
    let sc = secure.client;
    let reader = [("Authorization", "Bearer reader-secret-for-openapi")];
    k.check(
        "GET",
        "/v1/admin/snapshot",
        &sc.get("/v1/admin/snapshot").await,
    );
    let r = sc.request("GET", "/metrics", &reader, b"").await;
    assert_eq!(r.status, 403, "{}", r.text());
    k.check("GET", "/metrics", &r);
    // The document needs no token.
    k.check("GET", "/v1/openapi.json", &sc.get("/v1/openapi.json").await);
    secure.stop().await;

    // A one-member cluster: the cluster routes' successes and remaining refusals.
    let cluster = one_member_cluster().await;
    let cc = cluster.client;
    k.check("GET", "/v1/cluster", &cc.get("/v1/cluster").await);
    k.check(
        "POST",
        "/v1/cluster/transfer-leader",
        &cc.post("/v1/cluster/transfer-leader", &transfer).await,
    );
    let bad_member = json!({"id": 2, "peer_addr": "nowhere", "url": "http://127.0.0.1:2"});
    k.check(
        "POST",
        "/v1/cluster/members",
        &cc.post("/v1/cluster/members", &bad_member).await,
    );
    k.check(
        "DELETE",
        "/v1/cluster/members/{id}",
        &cc.delete("/v1/cluster/members/9").await,
    );
    cluster.stop().await;

    // Every operation answered with an error, and every one but these with a success:
    // adding a member needs a second server to catch up, removing one a cluster that
    // keeps a quorum without it; the probes, metrics and this document have no
    // client mistake to make, and `/readyz`'s 503 needs a server that is failing.
    let ops = documented(&k.doc);
    // An event stream's success never ends, so it is not a response to check here:
    // tests/watch_sse.rs reads its events.
    let no_success = [
        "POST /v1/cluster/members",
        "DELETE /v1/cluster/members/{id}",
        "GET /v1/watch",
    ];
    let no_error = ["GET /healthz", "GET /readyz", "GET /v1/openapi.json"];
    for op in &ops {
        assert!(
            k.successes.contains(op) || no_success.contains(&op.as_str()),
            "no success of {op} was checked"
        );
        assert!(
            k.errors.contains(op) || no_error.contains(&op.as_str()),
            "no error of {op} was checked"
        );
    }
}

/// The checker is only worth its passes if it fails: answers that differ from the
/// document, and a document that differs from the answers, are each refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_refuses_answers_that_differ_from_the_document() {
    let s = TestServer::start().await;
    let c = s.client;
    let doc = fetch_document(&c).await;
    let grant = c
        .post("/v1/acquire", &json!({"name": "doc:c", "ttl_ms": 30_000}))
        .await;
    assert_eq!(answer_matches(&doc, "POST", "/v1/acquire", &grant), Ok(()));
    let held = c
        .post("/v1/acquire", &json!({"name": "doc:c", "ttl_ms": 30_000}))
        .await;
    assert_eq!(answer_matches(&doc, "POST", "/v1/acquire", &held), Ok(()));

    let planted = |edit: &dyn Fn(&mut Value)| {
        let mut body = grant.json();
        edit(&mut body);
        let mut r = grant.clone();
        r.body = serde_json::to_vec(&body).unwrap();
        answer_matches(&doc, "POST", "/v1/acquire", &r)
    };
    type Edit = dyn Fn(&mut Value);
    let refused: [(&str, &Edit); 5] = [
        ("a required field missing", &|b| {
            b.as_object_mut().unwrap().remove("fence");
        }),
        ("a field of another type", &|b| b["fence"] = json!("1")),
        ("a negative fence", &|b| b["fence"] = json!(-1)),
        ("a field not in the document", &|b| b["lease_ms"] = json!(1)),
        ("null where a string is due", &|b| {
            b["session"] = Value::Null
        }),
    ];
    for (what, edit) in refused {
        assert!(planted(edit).is_err(), "the checker let through {what}");
    }
    // An error code that is not one of the documented codes.
    let mut r = held.clone();
    let mut body = held.json();
    body["error"]["code"] = json!("busy");
    r.body = serde_json::to_vec(&body).unwrap();
    assert!(answer_matches(&doc, "POST", "/v1/acquire", &r).is_err());
    // An audit entry (an `allOf` of the shared event fields and its own): a field
    // neither part declares, and a shared field of another type, are refused.
    c.post(
        "/v1/release",
        &json!({"name": "doc:c", "owner_token": grant.json()["owner_token"]}),
    )
    .await;
    let audit = c.get("/v1/audit?lock=doc:c").await;
    assert_eq!(answer_matches(&doc, "GET", "/v1/audit", &audit), Ok(()));
    for (what, edit) in [
        ("a field not in the document", json!({"bogus": 1})),
        ("a shared field of another type", json!({"time_ms": "now"})),
        (
            "an event name not in the vocabulary",
            json!({"kind": "grant"}),
        ),
    ] {
        let mut body = audit.json();
        for (k, v) in edit.as_object().unwrap() {
            body["entries"][0][k] = v.clone();
        }
        let mut r = audit.clone();
        r.body = serde_json::to_vec(&body).unwrap();
        assert!(
            answer_matches(&doc, "GET", "/v1/audit", &r).is_err(),
            "the checker let through {what}"
        );
    }
    // A status the document does not list for the route.
    let mut r = grant.clone();
    r.status = 202;
    assert!(answer_matches(&doc, "POST", "/v1/acquire", &r).is_err());

    // The document drifting from the handler: a renamed field.
    let mut drifted = doc.clone();
    let schema = &mut drifted["components"]["schemas"]["Grant"];
    let fence = schema["properties"]
        .as_object_mut()
        .unwrap()
        .remove("fence")
        .unwrap();
    schema["properties"]["fencing_token"] = fence;
    for required in schema["required"].as_array_mut().unwrap() {
        if required == "fence" {
            *required = json!("fencing_token");
        }
    }
    assert!(answer_matches(&drifted, "POST", "/v1/acquire", &grant).is_err());
    // A keyword the checker does not understand is refused, not skipped.
    let mut unknown = doc.clone();
    unknown["components"]["schemas"]["Grant"]["pattern"] = json!("^x");
    assert!(answer_matches(&unknown, "POST", "/v1/acquire", &grant).is_err());
    s.stop().await;
}

/// `since_ms` (the audit route's time filter) and the field rules of request bodies
/// are in the document, not only in the prose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_describes_since_ms_and_the_required_fields() {
    let s = TestServer::start().await;
    let doc = fetch_document(&s.client).await;
    let params = doc["paths"]["/v1/audit"]["get"]["parameters"]
        .as_array()
        .unwrap();
    let since = params
        .iter()
        .find(|p| p["name"] == "since_ms")
        .expect("since_ms is a documented parameter");
    assert_eq!(since["in"], "query");
    assert!(
        since["description"]
            .as_str()
            .unwrap()
            .contains("Unix epoch"),
        "{since}"
    );
    for name in ["until_ms", "kind"] {
        assert!(
            params
                .iter()
                .any(|p| p["name"] == name && p["in"] == "query"),
            "{name} is a documented parameter: {params:?}"
        );
    }
    // An entry's kind is one of the vocabulary's names, and nothing else.
    let kinds: Vec<&str> = doc["components"]["schemas"]["EventFields"]["properties"]["kind"]
        ["enum"]
        .as_array()
        .expect("kind is an enum")
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    for k in &kinds {
        assert!(
            fencelock_proto::vocab::Event::from_name(k).is_some(),
            "{k} is not a vocabulary name"
        );
    }
    assert!(kinds.contains(&"force_released") && kinds.contains(&"session_ended"));
    let renew = &doc["components"]["schemas"]["RenewRequest"];
    assert_eq!(renew["required"], json!(["name", "owner_token"]));
    assert_eq!(renew["additionalProperties"], json!(false));
    assert!(doc["info"]["description"]
        .as_str()
        .unwrap()
        .contains("a missing required field"));
    s.stop().await;
}

/// A watch event (the SSE `data:`) matches the document's `WatchEvent` schema, so
/// the fields it shares with the audit log cannot drift from what is described.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_events_match_the_documented_schema() {
    let s = TestServer::start().await;
    let c = s.client;
    let doc = fetch_document(&c).await;
    let mut live = c.send("GET", "/v1/watch?prefix=doc:w", &[], b"").await;
    let head = live.read_until("\r\n\r\n", Duration::from_secs(20)).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let g = c
        .post("/v1/acquire", &json!({"name": "doc:w", "ttl_ms": 30_000}))
        .await
        .json();
    c.post(
        "/v1/release",
        &json!({"name": "doc:w", "owner_token": g["owner_token"]}),
    )
    .await;
    // A third event, so that the first two have arrived whole.
    c.post("/v1/acquire", &json!({"name": "doc:wz", "ttl_ms": 30_000}))
        .await;
    let raw = live
        .read_until("\"name\":\"doc:wz\"", Duration::from_secs(20))
        .await;
    let events = support::sse_events(&format!("{head}{raw}"));
    let events = &events[..2];
    assert_eq!(events[1].event, "released", "{raw}");
    let schema = json!({"$ref": "#/components/schemas/WatchEvent"});
    for e in events {
        assert_eq!(checker::validate(&doc, &schema, &e.data, "$"), Ok(()));
        let mut bogus = e.data.clone();
        bogus["bogus"] = json!(1);
        assert!(checker::validate(&doc, &schema, &bogus, "$").is_err());
    }
}
