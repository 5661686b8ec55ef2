//! `fencelock token new`: makes a fresh random token, prints it once, and prints the
//! `[[auth.tokens]]` entry (with only the token's SHA-256) for the server's config.

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use fencelock_server::auth::{hash_token, new_token, Authenticator};
use fencelock_server::{AuthConfig, Role, TokenConfig};

/// `fencelock token …`.
#[derive(Debug, Args)]
pub struct TokenArgs {
    #[command(subcommand)]
    command: TokenCommand,
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Make a new token: prints the token (once; the server keeps only its hash) and
    /// the entry to add to the auth.tokens of the config.
    New {
        /// The token's name (A-Z a-z 0-9 _ . -, at most 64 bytes): shown in logs and
        /// the audit log, and scopes the token's request ids.
        #[arg(long)]
        name: String,
        /// reader (read-only), client (acquire/renew/release/sessions) or admin
        /// (everything, including force-release and backups).
        #[arg(long)]
        role: Role,
        /// Lock-name prefixes the token may touch; '' means every lock.
        #[arg(long = "prefix", required = true, num_args = 1..)]
        prefixes: Vec<String>,
    },
}

/// Runs `fencelock token …`.
pub fn run(args: TokenArgs) -> Result<ExitCode> {
    match args.command {
        TokenCommand::New {
            name,
            role,
            prefixes,
        } => new(name, role, prefixes),
    }
}

/// A TOML basic string: JSON's string escapes are all valid in TOML.
fn toml_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

fn new(name: String, role: Role, prefixes: Vec<String>) -> Result<ExitCode> {
    let token = new_token().context("cannot get random bytes from the operating system")?;
    let sha256 = hash_token(&token);
    let config = AuthConfig {
        tokens: vec![TokenConfig {
            name: name.clone(),
            role,
            prefixes: prefixes.clone(),
            sha256: sha256.clone(),
            acquire_rate: None,
            request_rate: None,
            quotas: Default::default(),
        }],
    };
    // The same checks the server makes on start, so the entry is known to be good.
    if let Err(e) = Authenticator::new(&config, None) {
        eprintln!("fencelock: error: {e}");
        return Ok(ExitCode::from(2));
    }
    let prefixes: Vec<String> = prefixes.iter().map(|p| toml_string(p)).collect();
    println!("# The token (shown only now; the server stores only its hash). Clients send");
    println!("# it as `Authorization: Bearer <token>`:");
    println!("{token}");
    println!();
    println!("# Add this to the server's config file:");
    println!("[[auth.tokens]]");
    println!("name = {}", toml_string(&name));
    println!("role = \"{role}\"");
    println!("prefixes = [{}]", prefixes.join(", "));
    println!("sha256 = \"{sha256}\"");
    Ok(ExitCode::SUCCESS)
}
