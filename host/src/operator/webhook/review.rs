//! Answering the API server: an `AdmissionReview` (v1) with the plugin's `validate`, a
//! `ConversionReview` (v1) with its `convert`. Every answer comes within the time the
//! API server waits: a plugin that traps, runs out of memory or time is answered for by
//! its failure policy, never by a hang.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::contract::FailurePolicy;
use crate::convert::{self, ConvertError};
use crate::plugin::Plugin;

/// The most warnings an answer carries, and the longest one (the API server truncates
/// longer ones, and `kubectl` prints each on a line).
const MAX_WARNINGS: usize = 16;
const MAX_WARNING_CHARS: usize = 256;
/// The longest refusal message passed on.
const MAX_MESSAGE_CHARS: usize = 1024;
/// Objects of one `ConversionReview` converted at once.
const CONVERSIONS_AT_ONCE: usize = 4;

/// A request body that is not the review it should be (answered with HTTP 400: the API
/// server then applies the webhook's failure policy).
#[derive(Debug, thiserror::Error)]
#[error("not a {kind} v1: {reason}")]
pub struct BadReview {
    kind: &'static str,
    reason: String,
}

/// Its apiVersion and kind are checked first, by `parse`.
#[derive(Debug, Deserialize)]
struct AdmissionReview {
    request: AdmissionRequest,
}

#[derive(Debug, Deserialize)]
struct AdmissionRequest {
    uid: String,
    operation: String,
    #[serde(default)]
    object: Option<Value>,
    #[serde(default, rename = "oldObject")]
    old_object: Option<Value>,
}

/// Its apiVersion and kind are checked first, by `parse`.
#[derive(Debug, Deserialize)]
struct ConversionReview {
    request: ConversionRequest,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConversionRequest {
    uid: String,
    #[serde(rename = "desiredAPIVersion")]
    desired_api_version: String,
    objects: Vec<Value>,
}

fn parse<T: for<'de> Deserialize<'de>>(
    body: &[u8],
    kind: &'static str,
    expected: &str,
) -> Result<T, BadReview> {
    // The review's apiVersion and kind first, skipping the rest without keeping it: a
    // body that is no such review costs no object tree.
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Head {
        #[serde(default)]
        api_version: String,
        #[serde(default)]
        kind: String,
    }
    let head: Head = serde_json::from_slice(body).map_err(|e| BadReview {
        kind,
        reason: e.to_string(),
    })?;
    if head.kind != kind || head.api_version != expected {
        return Err(BadReview {
            kind,
            reason: format!("it is a {} {}", head.kind, head.api_version),
        });
    }
    let review: T = serde_json::from_slice(body).map_err(|e| BadReview {
        kind,
        reason: e.to_string(),
    })?;
    Ok(review)
}

/// What a validating webhook decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed, with these warnings.
    Allowed(Vec<String>),
    /// Refused, with this message.
    Denied(String),
}

/// Decides an `AdmissionReview` (the request body) for `plugin`, or for no plugin
/// (none serves this path: answered by `policy`, the one the webhook was registered
/// with). Returns the response body. `within` bounds the plugin's call, whatever it
/// does (its own deadline usually ends it first).
pub async fn admission(
    body: &[u8],
    plugin: Option<&Plugin>,
    policy: FailurePolicy,
    within: Duration,
) -> Result<Value, BadReview> {
    let review: AdmissionReview = parse(body, "AdmissionReview", "admission.k8s.io/v1")?;
    let request = review.request;
    let verdict = match plugin {
        Some(plugin) => decide(plugin, &request, within).await,
        None => cannot_run(
            policy,
            "no plugin serves this webhook on this host (it is not loaded, or not yet)",
        ),
    };
    Ok(admission_response(&request.uid, verdict))
}

async fn decide(plugin: &Plugin, request: &AdmissionRequest, within: Duration) -> Verdict {
    let policy = plugin.info().validation.unwrap_or(FailurePolicy::Fail);
    let Some(new) = &request.object else {
        // DELETE and CONNECT carry no new object; the webhook is registered for
        // neither.
        return Verdict::Allowed(Vec::new());
    };
    let old = match request.operation.as_str() {
        "CREATE" => None,
        "UPDATE" => request.old_object.as_ref(),
        _ => return Verdict::Allowed(Vec::new()),
    };
    // A parent being deleted only loses finalizers: validation must never keep it.
    if old.is_some() && new.pointer("/metadata/deletionTimestamp").is_some() {
        return Verdict::Allowed(Vec::new());
    }
    match tokio::time::timeout(within, plugin.validate_async(old, new)).await {
        Ok(Ok(Ok(warnings))) => Verdict::Allowed(warnings),
        Ok(Ok(Err(refusal))) => Verdict::Denied(one_line(&refusal, MAX_MESSAGE_CHARS)),
        Ok(Err(failed)) => cannot_run(policy, &failed.to_string()),
        Err(_) => cannot_run(
            policy,
            &format!(
                "plugin {} did not answer within {:.1}s",
                plugin.info().name,
                within.as_secs_f64()
            ),
        ),
    }
}

/// The verdict when `validate` could not answer, per the failure policy.
fn cannot_run(policy: FailurePolicy, why: &str) -> Verdict {
    let why = one_line(why, MAX_MESSAGE_CHARS);
    match policy {
        FailurePolicy::Fail => Verdict::Denied(format!(
            "validation could not run, and its failure policy is Fail: {why}"
        )),
        FailurePolicy::Ignore => Verdict::Allowed(vec![format!(
            "validation could not run; allowed by failure policy Ignore: {why}"
        )]),
    }
}

/// The `AdmissionReview` answering request `uid` with `verdict`.
pub fn admission_response(uid: &str, verdict: Verdict) -> Value {
    let response = match verdict {
        Verdict::Allowed(warnings) => {
            let warnings: Vec<String> = warnings
                .iter()
                .map(|w| one_line(w, MAX_WARNING_CHARS))
                .filter(|w| !w.is_empty())
                .take(MAX_WARNINGS)
                .collect();
            let mut response = json!({"uid": uid, "allowed": true});
            if !warnings.is_empty() {
                response["warnings"] = json!(warnings);
            }
            response
        }
        Verdict::Denied(message) => json!({
            "uid": uid,
            "allowed": false,
            "status": {"code": 403, "reason": "Forbidden", "message": message},
        }),
    };
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
}

/// Answers a `ConversionReview` (the request body) with `plugin`'s `convert`, or
/// `Failure` when no plugin serves this path or one object cannot be converted (the
/// first failure ends the review). `within` bounds the whole review.
pub async fn conversion(
    body: &[u8],
    plugin: Option<&Plugin>,
    within: Duration,
) -> Result<Value, BadReview> {
    let review: ConversionReview = parse(body, "ConversionReview", "apiextensions.k8s.io/v1")?;
    let request = review.request;
    let result = match plugin {
        None => Err(
            "no plugin serves this conversion on this host (it is not loaded, or not yet)"
                .to_string(),
        ),
        Some(plugin) => {
            let to = request.desired_api_version.as_str();
            let all = futures::stream::iter(request.objects)
                .map(|object| convert::convert_async(plugin, object, to))
                .buffered(CONVERSIONS_AT_ONCE)
                .try_collect::<Vec<Value>>();
            match tokio::time::timeout(within, all).await {
                Ok(Ok(converted)) => Ok(converted),
                Ok(Err(e)) => Err(conversion_failure(&e)),
                Err(_) => Err(format!(
                    "plugin {} did not convert every object within {:.1}s",
                    plugin.info().name,
                    within.as_secs_f64()
                )),
            }
        }
    };
    let response = match result {
        Ok(converted) => json!({
            "uid": request.uid,
            "convertedObjects": converted,
            "result": {"status": "Success"},
        }),
        Err(message) => json!({
            "uid": request.uid,
            "convertedObjects": [],
            "result": {"status": "Failure", "message": one_line(&message, MAX_MESSAGE_CHARS)},
        }),
    };
    Ok(
        json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview", "response": response}),
    )
}

fn conversion_failure(e: &ConvertError) -> String {
    match e {
        ConvertError::Call(call) => format!("conversion could not run: {call}"),
        other => other.to_string(),
    }
}

/// `text` on one line (line breaks and control characters as spaces), at most `max`
/// characters.
fn one_line(text: &str, max: usize) -> String {
    let line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let line = line.trim();
    match line.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allowed_answer_carries_short_one_line_warnings() {
        let long = "x".repeat(300);
        let body = admission_response(
            "u1",
            Verdict::Allowed(vec!["two\nlines".into(), String::new(), long]),
        );
        assert_eq!(body["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(body["kind"], "AdmissionReview");
        assert_eq!(body["response"]["uid"], "u1");
        assert_eq!(body["response"]["allowed"], true);
        let warnings = body["response"]["warnings"].as_array().unwrap();
        assert_eq!(warnings.len(), 2, "the empty one is dropped: {warnings:?}");
        assert_eq!(warnings[0], "two lines");
        assert_eq!(warnings[1].as_str().unwrap().chars().count(), 257);
        assert!(body["response"].get("status").is_none());
        let quiet = admission_response("u2", Verdict::Allowed(vec![]));
        assert!(quiet["response"].get("warnings").is_none());
    }

    #[test]
    fn a_denial_is_a_forbidden_status_with_the_message() {
        let body = admission_response("u1", Verdict::Denied("no tickets for cats".into()));
        assert_eq!(body["response"]["allowed"], false);
        assert_eq!(body["response"]["status"]["code"], 403);
        assert_eq!(body["response"]["status"]["message"], "no tickets for cats");
    }

    #[test]
    fn a_policy_answers_when_validation_cannot_run() {
        match cannot_run(FailurePolicy::Fail, "plugin t: trap\nat 0x1") {
            Verdict::Denied(m) => {
                assert!(m.starts_with("validation could not run"), "{m}");
                assert!(m.ends_with("plugin t: trap at 0x1"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        match cannot_run(FailurePolicy::Ignore, "deadline") {
            Verdict::Allowed(w) => {
                assert_eq!(w.len(), 1);
                assert!(
                    w[0].contains("allowed by failure policy Ignore: deadline"),
                    "{w:?}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn without_a_plugin_the_registered_policy_answers() {
        let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u9", "operation": "CREATE", "object": {"kind": "X"}}});
        let body = serde_json::to_vec(&review).unwrap();
        let fail = admission(&body, None, FailurePolicy::Fail, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(fail["response"]["uid"], "u9");
        assert_eq!(fail["response"]["allowed"], false);
        assert!(
            fail["response"]["status"]["message"]
                .as_str()
                .unwrap()
                .contains("no plugin serves this webhook")
        );
        let ignore = admission(&body, None, FailurePolicy::Ignore, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(ignore["response"]["allowed"], true);
        assert_eq!(ignore["response"]["warnings"].as_array().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_body_that_is_no_review_is_refused() {
        for body in [
            &b"{"[..],
            br#"{"apiVersion": "admission.k8s.io/v1beta1", "request": {"uid": "u", "operation": "CREATE"}}"#,
            br#"{"apiVersion": "admission.k8s.io/v1"}"#,
        ] {
            let err = admission(body, None, FailurePolicy::Fail, Duration::from_secs(1))
                .await
                .unwrap_err();
            assert!(err.to_string().starts_with("not a AdmissionReview v1"), "{err}");
        }
        let err = conversion(
            br#"{"apiVersion": "apiextensions.k8s.io/v1"}"#,
            None,
            Duration::from_secs(1),
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains("ConversionReview"), "{err}");
    }

    #[tokio::test]
    async fn a_conversion_without_a_plugin_fails_with_a_reason() {
        let review = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "request": {"uid": "c1", "desiredAPIVersion": "test.capstan.dev/v2", "objects": [{}]}});
        let body = serde_json::to_vec(&review).unwrap();
        let answer = conversion(&body, None, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(answer["kind"], "ConversionReview");
        assert_eq!(answer["response"]["uid"], "c1");
        assert_eq!(answer["response"]["result"]["status"], "Failure");
        assert!(
            answer["response"]["result"]["message"]
                .as_str()
                .unwrap()
                .contains("no plugin serves this conversion")
        );
    }

    #[test]
    fn one_line_cuts_long_text_on_a_character_boundary() {
        assert_eq!(one_line("é".repeat(5).as_str(), 3), "ééé…");
        assert_eq!(one_line(" a\r\nb\t", 10), "a  b");
    }
}
