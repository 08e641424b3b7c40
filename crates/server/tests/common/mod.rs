//! What the server's test files share: the repository's fixtures and a server on a free port.

#![allow(dead_code)] // each test binary uses its own part

use std::path::PathBuf;

use oxlm_server::Server;

/// `tests/fixtures` of the repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Serves `server` on a free port of 127.0.0.1 in the background; its base URL.
pub async fn listen(server: Server) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server.serve(listener));
    base
}
