//! Plugins in a real OCI registry (go-containerregistry's `crane registry serve`, which
//! `cargo xtask test` builds and names in `CAPSTAN_CRANE`; these tests fail without it):
//! `capstan push` publishes, and the host's pull resolves a tag once, verifies the
//! signature of that digest, fetches by digest and caches by digest. No cluster.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use capstan::oci::{OciError, OciOptions, OciStore, parse_reference, sha256_digest};
use capstan::signature::VerifyKey;
use capstan_e2e::operator::{plugin, uuid_other_build};
use capstan_e2e::registry::Registry;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/keys")
        .join(name)
}

fn capstan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_capstan"))
        .args(args)
        .env(
            "CAPSTAN_CACHE_DIR",
            std::env::temp_dir().join("capstan-oci-tests"),
        )
        .output()
        .expect("run capstan")
}

/// `capstan push` of `file` to `tag` of `repository` (signed with the fixture key
/// `sign`); what it printed: the reference by digest.
fn push(registry: &Registry, file: &Path, repository_tag: &str, sign: Option<&str>) -> String {
    let reference = registry.reference(repository_tag);
    let mut args = vec![
        "push".to_string(),
        file.display().to_string(),
        reference,
        "--oci-plain-http".into(),
        registry.address.clone(),
    ];
    if let Some(key) = sign {
        args.extend(["--sign-key".into(), fixture(key).display().to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = capstan(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "capstan push: {stderr}");
    assert!(
        stderr.is_empty(),
        "capstan push said more than its reference: {stderr}"
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Runs crane (`$CAPSTAN_CRANE`, which `cargo xtask test` builds) with `args`; it must
/// succeed.
fn crane(args: &[&str]) {
    let crane = std::env::var_os("CAPSTAN_CRANE").expect(
        "CAPSTAN_CRANE is not set: run the tests with `cargo xtask test`, which builds crane",
    );
    let out = Command::new(crane).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "crane {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn store(registry: &Registry, cache: &Path, key: Option<&str>) -> OciStore {
    OciStore::new(OciOptions {
        cache: cache.to_path_buf(),
        plain_http: vec![registry.address.clone()],
        credentials: Default::default(),
        verify_key: key.map(|k| VerifyKey::from_pem_file(&fixture(k)).unwrap()),
    })
}

#[tokio::test]
async fn a_pushed_plugin_is_pulled_by_digest_only_then_from_the_cache() {
    let mut registry = Registry::start().unwrap();
    let file = plugin("uuid");
    let bytes = std::fs::read(&file).unwrap();
    let printed = push(&registry, &file, "plugins/uuid:1", Some("signer.key"));
    let prefix = format!("oci://{}/plugins/uuid@sha256:", registry.address);
    assert!(printed.starts_with(&prefix), "{printed}");
    let digest = printed.rsplit('@').next().unwrap().to_string();

    let cache = tempfile::tempdir().unwrap();
    let store = store(&registry, cache.path(), Some("signer.pub"));
    let by_tag = parse_reference(&registry.reference("plugins/uuid:1")).unwrap();
    let mark = registry.mark();
    let pulled = store.pull(&by_tag).await.unwrap();
    assert_eq!(pulled.digest, digest);
    assert_eq!(pulled.bytes, bytes, "the component as pushed");

    // The tag was only resolved (HEAD); everything fetched was fetched by digest, the
    // signature image included: no check-then-use window for a moved tag.
    let layer = sha256_digest(&bytes);
    let requests =
        registry.requests_since_including(mark, &format!("GET /v2/plugins/uuid/blobs/{layer}"));
    let manifests: Vec<&String> = requests
        .iter()
        .filter(|r| r.contains("/manifests/"))
        .collect();
    assert!(
        manifests.contains(&&"HEAD /v2/plugins/uuid/manifests/1".to_string()),
        "{requests:#?}"
    );
    for request in &manifests {
        assert!(
            request.starts_with("HEAD ") || request.contains("/manifests/sha256:"),
            "a manifest fetched by tag: {request} in {requests:#?}"
        );
    }
    assert!(
        requests.contains(&format!("GET /v2/plugins/uuid/blobs/{layer}")),
        "{requests:#?}"
    );

    // Again: resolved and verified again, the component not downloaded again.
    let mark = registry.mark();
    assert_eq!(store.pull(&by_tag).await.unwrap().bytes, bytes);
    let again = registry.requests_since(mark);
    assert!(
        !again.iter().any(|r| r.contains(&layer)),
        "the cached component was fetched again: {again:#?}"
    );

    // Without the registry: a reference by digest is served from the cache (without a
    // key: with one, the signature is checked again, which needs the registry); a tag
    // cannot be resolved, and says so in one line.
    registry.stop();
    let unverified = self::store(&registry, cache.path(), None);
    let by_digest = parse_reference(&printed).unwrap();
    assert_eq!(unverified.pull(&by_digest).await.unwrap().bytes, bytes);
    let err = unverified.pull(&by_tag).await.unwrap_err().to_string();
    assert!(err.contains("plugins/uuid:1"), "{err}");
    assert!(!err.contains('\n'), "{err}");
    let err = store.pull(&by_digest).await.unwrap_err();
    assert!(matches!(err, OciError::Registry { .. }), "{err}");
}

#[tokio::test]
async fn with_a_key_only_a_signature_of_that_very_digest_lets_a_plugin_in() {
    let registry = Registry::start().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let store = store(&registry, cache.path(), Some("signer.pub"));
    let pull = |tag: &str| {
        let reference = parse_reference(&registry.reference(tag)).unwrap();
        let store = &store;
        async move { store.pull(&reference).await }
    };

    push(&registry, &plugin("uuid"), "plugins/uuid:unsigned", None);
    let err = pull("plugins/uuid:unsigned").await.unwrap_err().to_string();
    assert!(err.contains("refused: no signature ("), "{err}");
    assert!(err.contains(".sig not found) and --verify-key"), "{err}");

    push(
        &registry,
        &plugin("uuid"),
        "plugins/other:1",
        Some("other.key"),
    );
    let err = pull("plugins/other:1").await.unwrap_err().to_string();
    assert!(
        err.contains("refused: no signature by") && err.contains("does not match the key"),
        "{err}"
    );

    // Signed, then the tag moved to other bytes nobody signed: the signature names the
    // old digest, so the new one is refused.
    push(
        &registry,
        &plugin("uuid"),
        "plugins/moved:1",
        Some("signer.key"),
    );
    pull("plugins/moved:1").await.unwrap();
    push(&registry, &uuid_other_build(), "plugins/moved:1", None);
    let err = pull("plugins/moved:1").await.unwrap_err().to_string();
    assert!(err.contains("refused: no signature ("), "{err}");
    // Signed too: taken.
    push(
        &registry,
        &uuid_other_build(),
        "plugins/moved:1",
        Some("signer.key"),
    );
    let pulled = pull("plugins/moved:1").await.unwrap();
    assert_eq!(pulled.bytes, std::fs::read(uuid_other_build()).unwrap());

    // Hostile: a signed image copied, with its signature, into another repository. The
    // bytes and the digest are the same; the signature names the repository it was
    // made for, so it does not let the copy in.
    let printed = push(
        &registry,
        &plugin("uuid"),
        "plugins/signed:1",
        Some("signer.key"),
    );
    pull("plugins/signed:1").await.unwrap();
    let digest = printed
        .rsplit_once('@')
        .expect("pushed by digest")
        .1
        .to_string();
    let signature_tag = digest.replace(':', "-") + ".sig";
    for (from, to) in [
        (
            "plugins/signed:1".to_string(),
            "plugins/stolen:1".to_string(),
        ),
        (
            format!("plugins/signed:{signature_tag}"),
            format!("plugins/stolen:{signature_tag}"),
        ),
    ] {
        crane(&[
            "copy",
            "--insecure",
            registry.reference(&from).trim_start_matches("oci://"),
            registry.reference(&to).trim_start_matches("oci://"),
        ]);
    }
    let err = pull("plugins/stolen:1").await.unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "signs the image of {}/plugins/signed, not of {}/plugins/stolen",
            registry.address, registry.address
        )),
        "{err}"
    );
}

#[tokio::test]
async fn an_artifact_that_is_not_a_wasm_component_is_refused() {
    let registry = Registry::start().unwrap();
    // An image in the registry's usual layout (crane's own: a tar layer), not a plugin.
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("layer.tar");
    std::fs::write(&layer, [0u8; 1024]).unwrap();
    let tag = format!("{}/images/app:1", registry.address);
    crane(&[
        "append",
        "--insecure",
        "--oci-empty-base",
        "-f",
        layer.to_str().unwrap(),
        "-t",
        &tag,
    ]);
    let cache = tempfile::tempdir().unwrap();
    let err = store(&registry, cache.path(), None)
        .pull(&parse_reference(&tag).unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not a Wasm component artifact: it needs exactly one application/wasm layer"),
        "{err}"
    );
}

#[test]
fn push_refuses_what_is_not_a_plugin_or_not_a_reference_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "hello").unwrap();
    let uuid = plugin("uuid");
    for (args, says) in [
        (
            vec!["push", text.to_str().unwrap(), "oci://127.0.0.1:1/p/x:1"],
            "is not a WebAssembly component",
        ),
        (
            vec!["push", uuid.to_str().unwrap(), "uuid:1"],
            "\"uuid:1\" is not an OCI reference",
        ),
        (
            vec![
                "push",
                uuid.to_str().unwrap(),
                "oci://127.0.0.1:1/p/x:1",
                "--sign-key",
                fixture("signer.pub").to_str().unwrap(),
            ],
            "not a PEM private key",
        ),
    ] {
        let out = capstan(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
    }
}

#[test]
fn capstan_sign_writes_the_signature_the_host_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let wasm = dir.path().join("uuid.wasm");
    std::fs::copy(plugin("uuid"), &wasm).unwrap();
    let out = capstan(&[
        "sign",
        wasm.to_str().unwrap(),
        "--key",
        fixture("signer.key").to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sig = dir.path().join("uuid.wasm.sig");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        sig.display().to_string()
    );
    let signature = std::fs::read_to_string(&sig).unwrap();
    let bytes = std::fs::read(&wasm).unwrap();
    VerifyKey::from_pem_file(&fixture("signer.pub"))
        .unwrap()
        .verify(&bytes, &signature)
        .unwrap();
    assert!(
        VerifyKey::from_pem_file(&fixture("other.pub"))
            .unwrap()
            .verify(&bytes, &signature)
            .is_err()
    );
}
