//! `capstan run` at start, before any cluster work: an API server that is not there yet.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A host started while the API server is down (a control plane restarting) waits for
/// it instead of exiting: the server appears a second later, on the same port, and the
/// host connects to it.
#[test]
fn run_waits_for_an_api_server_that_is_not_up_yet() {
    let port = {
        // A free port, closed again: nothing listens there until the "server" starts.
        let probe = TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:{port}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n"
        ),
    )
    .unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    let mut host = Command::new(env!("CARGO_BIN_EXE_capstan"))
        .args(["run", "--plugins", plugins.to_str().unwrap()])
        .args(["--kubeconfig", kubeconfig.to_str().unwrap()])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env("CAPSTAN_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run capstan");
    // Every log line, as it comes (the host logs to stdout or stderr).
    let (lines_tx, lines) = mpsc::channel::<String>();
    for out in [
        Box::new(host.stdout.take().unwrap()) as Box<dyn Read + Send>,
        Box::new(host.stderr.take().unwrap()),
    ] {
        let tx = lines_tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    drop(lines_tx);
    let mut log = Vec::new();
    let wait_for = |needle: &str, log: &mut Vec<String>| {
        while let Ok(line) = lines.recv_timeout(Duration::from_secs(60)) {
            let found = line.contains(needle);
            log.push(line);
            if found {
                return true;
            }
        }
        false
    };
    assert!(
        wait_for("cannot reach the API server yet", &mut log),
        "no retry logged: {log:#?}"
    );
    // The API server comes up: it answers /version, and nothing else is asked here.
    let server = TcpListener::bind(("127.0.0.1", port)).unwrap();
    std::thread::spawn(move || {
        for stream in server.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = [0u8; 4096];
            let n = stream.read(&mut request).unwrap_or(0);
            let head = String::from_utf8_lossy(&request[..n]).into_owned();
            let (status, body) = if head.starts_with("GET /version") {
                (
                    "200 OK",
                    r#"{"major":"1","minor":"37","gitVersion":"v1.37.2","gitCommit":"","gitTreeState":"","buildDate":"","goVersion":"","compiler":"","platform":"linux/amd64"}"#,
                )
            } else {
                (
                    "404 Not Found",
                    r#"{"kind":"Status","apiVersion":"v1","status":"Failure","code":404}"#,
                )
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let connected = wait_for("connected to the API server", &mut log);
    let _ = host.kill();
    let _ = host.wait();
    assert!(
        connected,
        "the host did not connect once the server was up: {log:#?}"
    );
}

/// A canary schedule that makes no sense is refused before anything starts: one line,
/// a non-zero exit, no cluster needed.
#[test]
fn run_refuses_a_canary_schedule_that_makes_no_sense() {
    let dir = tempfile::tempdir().unwrap();
    for (steps, says) in [
        ("50,10,100", "--canary-steps must go up: 50,10,100"),
        ("10,50", "--canary-steps must end at 100"),
        ("0,100", "0 is not a share between 1 and 100 percent"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_capstan"))
            .args(["run", "--plugins", dir.path().to_str().unwrap()])
            .args(["--canary", "--canary-steps", steps])
            .args(["--kubeconfig", "/nonexistent"])
            .output()
            .expect("run capstan");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{steps}: {stderr}");
        assert!(stderr.contains(says), "{steps}: {stderr}");
        assert_eq!(
            stderr.trim().lines().count(),
            1,
            "{steps}: one line: {stderr}"
        );
    }
    // The schedule's flags need --canary.
    let out = Command::new(env!("CARGO_BIN_EXE_capstan"))
        .args(["run", "--plugins", dir.path().to_str().unwrap()])
        .args(["--canary-steps", "50,100"])
        .output()
        .expect("run capstan");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--canary"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A `--plugin` that names no registry, or a `--verify-key` that is no key, is refused
/// before anything starts: one line, a non-zero exit, no cluster needed.
#[test]
fn run_refuses_a_bad_reference_or_key_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_key = dir.path().join("key.pub");
    std::fs::write(&not_a_key, "hello").unwrap();
    for (args, says) in [
        (
            vec!["--plugin", "uuid:1"],
            "\"uuid:1\" is not an OCI reference (oci://REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST]): name the registry",
        ),
        (
            vec!["--verify-key", "/nonexistent/cosign.pub"],
            "cannot read the key /nonexistent/cosign.pub",
        ),
        (
            vec!["--verify-key", not_a_key.to_str().unwrap()],
            "not a PEM public key",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_capstan"))
            .args(["run", "--plugins", dir.path().to_str().unwrap()])
            .args(&args)
            .args(["--kubeconfig", "/nonexistent"])
            .output()
            .expect("run capstan");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
    }
}

/// A machine (or image) without CA roots: `run` starts as ever (no registry client is
/// needed until a plugin names a registry), and `push` says why it cannot, in one line.
#[test]
fn without_ca_roots_run_starts_and_push_says_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let no_roots = [
        ("SSL_CERT_FILE", "/nonexistent/ca.crt"),
        ("SSL_CERT_DIR", "/nonexistent/certs"),
    ];
    // `run` gets as far as the kubeconfig (which does not exist), and no panic.
    let out = Command::new(env!("CARGO_BIN_EXE_capstan"))
        .args(["run", "--plugins", dir.path().to_str().unwrap()])
        .args(["--kubeconfig", "/nonexistent/kubeconfig"])
        .envs(no_roots)
        .output()
        .expect("run capstan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("/nonexistent/kubeconfig"), "{stderr}");

    let plugin = capstan_e2e::operator::plugin("uuid");
    let out = Command::new(env!("CARGO_BIN_EXE_capstan"))
        .args([
            "push",
            plugin.to_str().unwrap(),
            "oci://127.0.0.1:1/plugins/uuid:1",
        ])
        .envs(no_roots)
        .output()
        .expect("run capstan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot make the registry client"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}
