//! What a reconcile returns: children, status, conditions, events, requeue.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use crate::Error;
use crate::bindings::capstan::plugin::types as wit;

/// The desired state of one parent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Desired {
    children: Vec<Value>,
    status: Option<Value>,
    conditions: Vec<Condition>,
    events: Vec<Event>,
    requeue_after: Option<Duration>,
}

impl Desired {
    /// Nothing desired yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a child manifest: any serializable object with `apiVersion`, `kind` and
    /// `metadata.name` (k8s-openapi types write their `apiVersion` and `kind`). Leave the
    /// namespace and ownerReferences out: the host sets them.
    pub fn child<T: Serialize>(&mut self, object: &T) -> Result<&mut Self, Error> {
        let value = serde_json::to_value(object)
            .map_err(|e| Error::retry(format!("cannot serialize a child: {e}")))?;
        self.children.push(value);
        Ok(self)
    }

    /// Sets the plugin's status fields. The host adds `observedGeneration` and `conditions`.
    pub fn status<T: Serialize>(&mut self, status: &T) -> Result<&mut Self, Error> {
        let value = serde_json::to_value(status)
            .map_err(|e| Error::retry(format!("cannot serialize the status: {e}")))?;
        self.status = Some(value);
        Ok(self)
    }

    /// Adds a condition. One of type `Ready` replaces the host's own.
    pub fn condition(&mut self, condition: Condition) -> &mut Self {
        self.conditions.push(condition);
        self
    }

    /// Adds an event to post on the parent.
    pub fn event(&mut self, event: Event) -> &mut Self {
        self.events.push(event);
        self
    }

    /// Reconcile again after `delay` even if nothing changes (whole seconds, at least 1).
    pub fn requeue_after(&mut self, delay: Duration) -> &mut Self {
        self.requeue_after = Some(delay);
        self
    }

    /// The children added so far.
    pub fn children(&self) -> &[Value] {
        &self.children
    }

    /// The status set so far.
    pub fn status_value(&self) -> Option<&Value> {
        self.status.as_ref()
    }

    /// The conditions added so far.
    pub fn conditions(&self) -> &[Condition] {
        &self.conditions
    }

    /// The events added so far.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// The requeue delay, if set.
    pub fn requeue(&self) -> Option<Duration> {
        self.requeue_after
    }

    pub(crate) fn into_wit(self) -> wit::Desired {
        wit::Desired {
            // Straight into a byte buffer: `Value`'s `Display` escapes through a
            // `fmt::Formatter`, one indirect write at a time, and a child may hold tens of
            // KiB of script (#39). The text is the same.
            children: self.children.iter().map(json_text).collect(),
            status: self.status.as_ref().map(json_text),
            conditions: self
                .conditions
                .into_iter()
                .map(Condition::into_wit)
                .collect(),
            events: self.events.into_iter().map(Event::into_wit).collect(),
            requeue_after_seconds: self.requeue_after.map(seconds),
        }
    }
}

fn seconds(d: Duration) -> u32 {
    d.as_secs().clamp(1, u64::from(u32::MAX)) as u32
}

/// Status of a condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConditionStatus {
    /// Holds.
    True,
    /// Does not hold.
    False,
    /// Not known.
    Unknown,
}

/// A condition on the parent's status, as `metav1.Condition` (the host sets the times).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// CamelCase type.
    pub type_: String,
    /// Status.
    pub status: ConditionStatus,
    /// CamelCase reason.
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

impl Condition {
    /// A condition of `type_` that holds or not.
    pub fn new(type_: &str, holds: bool, reason: &str, message: impl Into<String>) -> Self {
        Condition {
            type_: type_.into(),
            status: if holds {
                ConditionStatus::True
            } else {
                ConditionStatus::False
            },
            reason: reason.into(),
            message: message.into(),
        }
    }

    fn into_wit(self) -> wit::Condition {
        wit::Condition {
            type_: self.type_,
            status: match self.status {
                ConditionStatus::True => wit::ConditionStatus::True,
                ConditionStatus::False => wit::ConditionStatus::False,
                ConditionStatus::Unknown => wit::ConditionStatus::Unknown,
            },
            reason: self.reason,
            message: self.message,
        }
    }
}

/// Normal or Warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Something expected happened.
    Normal,
    /// Something went wrong.
    Warning,
}

/// An event the host posts on the parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Normal or Warning.
    pub type_: EventType,
    /// CamelCase reason.
    pub reason: String,
    /// Human-readable message; never put secrets here.
    pub message: String,
}

impl Event {
    /// A Normal event.
    pub fn normal(reason: &str, message: impl Into<String>) -> Self {
        Event {
            type_: EventType::Normal,
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// A Warning event.
    pub fn warning(reason: &str, message: impl Into<String>) -> Self {
        Event {
            type_: EventType::Warning,
            reason: reason.into(),
            message: message.into(),
        }
    }

    fn into_wit(self) -> wit::Event {
        wit::Event {
            type_: match self.type_ {
                EventType::Normal => wit::EventType::Normal,
                EventType::Warning => wit::EventType::Warning,
            },
            reason: self.reason,
            message: self.message,
        }
    }
}

/// What `finalize` returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finalized {
    done: bool,
    events: Vec<Event>,
    requeue_after: Option<Duration>,
    /// Children to delete in this wave: (apiVersion, kind, name).
    delete: Vec<(String, String, String)>,
}

impl Finalized {
    /// Cleanup is complete; the host removes its finalizer.
    pub fn done() -> Self {
        Finalized {
            done: true,
            events: Vec::new(),
            requeue_after: None,
            delete: Vec::new(),
        }
    }

    /// Cleanup is still under way; call again after `delay`.
    pub fn pending(delay: Duration) -> Self {
        Finalized {
            done: false,
            events: Vec::new(),
            requeue_after: Some(delay),
            delete: Vec::new(),
        }
    }

    /// A teardown wave: the host deletes the children named with [`Finalized::delete`]
    /// (only those this parent controls), waits until they are gone, and calls
    /// `finalize` again. Return the next wave from there, or [`Finalized::done`] when
    /// nothing is left to order. A wave that names no child observed is over at once.
    pub fn wave() -> Self {
        Finalized {
            done: false,
            events: Vec::new(),
            requeue_after: None,
            delete: Vec::new(),
        }
    }

    /// Names an observed child of type `K` to delete in this wave.
    pub fn delete<K: k8s_openapi::Resource>(self, name: &str) -> Self {
        self.delete_raw(K::API_VERSION, K::KIND, name)
    }

    /// Names an observed child to delete in this wave, by `apiVersion` and `kind`.
    pub fn delete_raw(mut self, api_version: &str, kind: &str, name: &str) -> Self {
        self.delete
            .push((api_version.into(), kind.into(), name.into()));
        self
    }

    /// The children this wave deletes: (apiVersion, kind, name).
    pub fn deletes(&self) -> &[(String, String, String)] {
        &self.delete
    }

    /// Adds an event.
    pub fn event(mut self, event: Event) -> Self {
        self.events.push(event);
        self
    }

    /// Whether cleanup is complete.
    pub fn is_done(&self) -> bool {
        self.done
    }

    pub(crate) fn into_wit(self, info: &crate::PluginInfo) -> Result<wit::FinalizeResult, Error> {
        let delete = self
            .delete
            .into_iter()
            .map(|(api_version, kind, name)| {
                let index = info.child_index(&api_version, &kind).ok_or_else(|| {
                    Error::invalid(format!(
                        "finalize names {kind} {name:?} ({api_version}), not a declared child kind"
                    ))
                })?;
                Ok(wit::ChildRef {
                    kind_index: index as u32,
                    name,
                })
            })
            .collect::<Result<_, Error>>()?;
        Ok(wit::FinalizeResult {
            done: self.done,
            events: self.events.into_iter().map(Event::into_wit).collect(),
            requeue_after_seconds: self.requeue_after.map(seconds),
            delete,
        })
    }
}

/// `value` as compact JSON text (what `value.to_string()` gives, written faster).
fn json_text(value: &Value) -> String {
    serde_json::to_string(value).expect("a JSON value always serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_text_is_the_text_display_gives() {
        let value = serde_json::json!({
            "data": {"entrypoint.sh": "#!/bin/sh\n\tset -eu\n\"quoted\" \\ back \u{1} é"},
            "list": [1, 2.5, null, true],
        });
        assert_eq!(json_text(&value), value.to_string());
    }
}
