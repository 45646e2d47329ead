//! Writing a desired child under the ownership rules: a create-only apply for a child
//! the caches do not show, a forced apply for one this parent controls, adoption with
//! consent, and a conflict (nothing written) for anything else.

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};

use super::{ClusterWrites, Result, api_resource, is_status, request};
use crate::contract::KindRef;
use crate::ownership::{self, Ownership};
use crate::plan::PlannedChild;

/// The resourceVersion that makes a server-side apply create-only.
///
/// An apply that carries a resourceVersion is an update with that precondition when the
/// object exists (the API server answers 409 unless it matches), and a plain create
/// when it does not (the version is then not compared, and the stored object gets its
/// own). No object ever has this version (u64::MAX; etcd revisions are signed 64-bit),
/// so such an apply creates the object or is refused, never writes an existing one.
/// A create (POST) would not do: its fields are owned by an `Update` entry of the
/// manager, which the manager's later applies can never remove (docs/operator.md,
/// "Ownership").
pub const CREATE_ONLY: &str = "18446744073709551615";

/// A plugin's declared child kinds, resolved for the API.
#[derive(Clone)]
pub struct ChildKinds {
    pub(super) kinds: Vec<(KindRef, ApiResource)>,
}

impl ChildKinds {
    /// Resolves the declared kinds.
    pub fn new(kinds: &[KindRef]) -> Self {
        ChildKinds {
            kinds: kinds.iter().map(|k| (k.clone(), api_resource(k))).collect(),
        }
    }

    /// The declared kind at `index`.
    pub fn kind(&self, index: usize) -> &KindRef {
        &self.kinds[index].0
    }
}

/// What happened to one desired child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildOutcome {
    /// Written (created, or updated because this parent controls it).
    Applied {
        /// The object's resourceVersion after the write.
        resource_version: Option<String>,
    },
    /// An existing object that consented to it was adopted, then written.
    Adopted,
    /// An existing object of that name is not this parent's: nothing was written.
    Conflict(OwnershipConflict),
}

/// A desired child whose name is taken by an object this parent does not control.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{kind} {name:?} already exists and is {}; nothing was written to it (to hand it over, remove its controller and annotate it {annotation}={adoption})",
    match .controller { Some(c) => format!("controlled by {c}"), None => "not controlled by this parent".to_string() },
    annotation = ownership::ADOPT_ANNOTATION
)]
pub struct OwnershipConflict {
    /// The child's kind.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Its controller, if it has one.
    pub controller: Option<String>,
    /// The annotation value that would let this parent adopt it.
    pub adoption: String,
}

impl ClusterWrites {
    /// Writes one desired child under the ownership rules ([`crate::ownership`]).
    ///
    /// `observed` says whether the child is among the parent's observed children (which
    /// only ever holds objects this parent controls): then it is applied directly.
    /// Otherwise it is most likely new, and is created by a create-only apply (one
    /// request; see [`CREATE_ONLY`]). Only if its name is taken (409) is the object read:
    /// controlled by this parent (a cache that lags), it is applied; consenting to
    /// adoption, adopted; anything else is an [`OwnershipConflict`] and nothing is
    /// written.
    pub async fn apply_child(
        &self,
        kinds: &ChildKinds,
        parent: &DynamicObject,
        child: &PlannedChild,
        observed: bool,
    ) -> Result<ChildOutcome> {
        let (outcome, _) = self
            .write_child(kinds, parent, child, observed, false)
            .await?;
        Ok(outcome)
    }

    /// [`Self::apply_child`] as a dry run (`dryRun=All`): the same requests, which the API
    /// server validates, defaults and admits but does not store. Returns the outcome and,
    /// when applied, the object as the apply would leave it (`capstan plan --live`).
    pub async fn dry_run_child(
        &self,
        kinds: &ChildKinds,
        parent: &DynamicObject,
        child: &PlannedChild,
        observed: bool,
    ) -> Result<(ChildOutcome, Option<DynamicObject>)> {
        self.write_child(kinds, parent, child, observed, true).await
    }

    async fn write_child(
        &self,
        kinds: &ChildKinds,
        parent: &DynamicObject,
        child: &PlannedChild,
        observed: bool,
        dry_run: bool,
    ) -> Result<(ChildOutcome, Option<DynamicObject>)> {
        let (kind, ar) = &kinds.kinds[child.kind_index];
        let ns = child
            .manifest
            .pointer("/metadata/namespace")
            .and_then(Value::as_str);
        let api = self.child_api(ar, kind.namespaced, ns);
        let action = || format!("apply {} {:?}", kind.kind, child.name);
        if observed {
            return self.apply_owned(&api, child, dry_run, action).await;
        }
        let create = || format!("create {} {:?}", kind.kind, child.name);
        let taken = match self.create_child(&api, child, dry_run, create).await {
            Err(e) if is_status(&e, 409) => e,
            created => return created,
        };
        let existing = request(
            || format!("read {} {:?}", kind.kind, child.name),
            api.get_opt(&child.name),
        )
        .await?;
        // Taken a moment ago, gone now: a conflict, retried soon.
        let Some(existing) = existing else {
            return Err(taken);
        };
        let parent_uid = parent.metadata.uid.as_deref().unwrap_or_default();
        let adoption = ownership::adoption_ref(&self.parent_kind, &parent.name_any());
        match ownership::ownership(&existing.metadata, parent_uid, &adoption) {
            Ownership::Controlled => self.apply_owned(&api, child, dry_run, action).await,
            Ownership::Adoptable => {
                let (_, written) = self.apply_owned(&api, child, dry_run, action).await?;
                Ok((ChildOutcome::Adopted, written))
            }
            Ownership::Foreign { controller } => Ok((
                ChildOutcome::Conflict(OwnershipConflict {
                    kind: kind.kind.clone(),
                    name: child.name.clone(),
                    controller,
                    adoption,
                }),
                None,
            )),
        }
    }

    /// Creates a child with a create-only apply: the same request as
    /// [`Self::apply_owned`]'s (so the object is owned exactly as an apply owns it), with
    /// the [`CREATE_ONLY`] resourceVersion. An object of that name, whoever it is, is
    /// answered with 409 and left untouched.
    async fn create_child(
        &self,
        api: &Api<DynamicObject>,
        child: &PlannedChild,
        dry_run: bool,
        action: impl FnOnce() -> String,
    ) -> Result<(ChildOutcome, Option<DynamicObject>)> {
        let mut manifest = child.manifest.clone();
        manifest["metadata"]["resourceVersion"] = json!(CREATE_ONLY);
        let mut params = PatchParams::apply(&self.manager);
        params.dry_run = dry_run;
        let written = self
            .write(
                action,
                api.patch(&child.name, &params, &Patch::Apply(&manifest)),
            )
            .await?;
        Ok(applied(written))
    }

    /// Server-side applies, with force, a child this parent controls (or is adopting),
    /// with the plugin's field manager.
    async fn apply_owned(
        &self,
        api: &Api<DynamicObject>,
        child: &PlannedChild,
        dry_run: bool,
        action: impl FnOnce() -> String,
    ) -> Result<(ChildOutcome, Option<DynamicObject>)> {
        let mut params = PatchParams::apply(&self.manager).force();
        params.dry_run = dry_run;
        let written = self
            .write(
                action,
                api.patch(&child.name, &params, &Patch::Apply(&child.manifest)),
            )
            .await?;
        Ok(applied(written))
    }
}

fn applied(written: DynamicObject) -> (ChildOutcome, Option<DynamicObject>) {
    let outcome = ChildOutcome::Applied {
        resource_version: written.metadata.resource_version.clone(),
    };
    (outcome, Some(written))
}

#[cfg(test)]
mod tests {
    use http::Method;
    use serde_json::{Value, json};

    use super::*;
    use crate::operator::cluster::ErrorClass;
    use crate::operator::cluster::fixtures::{child, configmaps, fake, parent};
    use crate::operator::fake_api::{self, Call};

    fn existing(owner_uid: Option<&str>, annotations: Value) -> Value {
        let owners = owner_uid.map(|uid| {
            json!([{"apiVersion": "test.capstan.dev/v1", "kind": "Widget", "name": "other",
                    "uid": uid, "controller": true}])
        });
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "c", "namespace": "ns", "uid": "uid-c", "resourceVersion": "5",
                            "ownerReferences": owners, "annotations": annotations,
                            "managedFields": [{"manager": "capstan/widget", "operation": "Apply"}]},
               "data": {"k": "mine"}})
    }

    fn is_create_only(call: &Call) -> bool {
        call.body["metadata"]["resourceVersion"] == CREATE_ONLY
    }

    /// A handler that behaves like the API server towards `c`, which exists as `existing`
    /// (or not): a create-only apply creates it when absent and is refused with 409 when
    /// present; any other apply writes it.
    fn server(existing: Option<Value>) -> impl Fn(&Call) -> (u16, Value) + Send + Sync + 'static {
        move |call: &Call| match (&call.method, &existing) {
            (&Method::GET, Some(obj)) => (200, obj.clone()),
            (&Method::GET, None) => fake_api::status(404, "NotFound", "not found"),
            (&Method::PATCH, Some(_)) if is_create_only(call) => fake_api::status(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version and try again",
            ),
            (&Method::PATCH, None) if is_create_only(call) => {
                (201, fake_api::applied(&call.body, json!([])).1)
            }
            (&Method::PATCH, _) => fake_api::applied(&call.body, json!([])),
            _ => fake_api::status(405, "MethodNotAllowed", "unexpected"),
        }
    }

    const CM: &str = "/api/v1/namespaces/ns/configmaps/c";

    #[tokio::test]
    async fn an_object_the_parent_does_not_control_is_read_and_never_written() {
        for obj in [
            existing(None, json!({})),
            existing(Some("uid-other"), json!({})),
            existing(
                Some("uid-other"),
                json!({"capstan.dev/allow-adoption-by": "widgets.test.capstan.dev/w"}),
            ),
            existing(
                None,
                json!({"capstan.dev/allow-adoption-by": "widgets.test.capstan.dev/another"}),
            ),
        ] {
            let (writes, calls) = fake(server(Some(obj)));
            let outcome = writes
                .apply_child(&configmaps(), &parent(), &child("c"), false)
                .await
                .unwrap();
            assert!(matches!(outcome, ChildOutcome::Conflict(_)), "{outcome:?}");
            assert_eq!(
                calls.summary(),
                [format!("PATCH {CM}"), format!("GET {CM}")]
            );
            assert!(
                is_create_only(&calls.all()[0]),
                "the only write is create-only, refused for an existing object"
            );
        }
    }

    #[tokio::test]
    async fn a_dry_run_makes_the_same_requests_with_dry_run_and_returns_the_object() {
        // Absent: the create-only apply, as a dry run.
        let (writes, calls) = fake(server(None));
        let (outcome, object) = writes
            .dry_run_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap();
        assert!(
            matches!(outcome, ChildOutcome::Applied { .. }),
            "{outcome:?}"
        );
        assert_eq!(object.unwrap().metadata.name.as_deref(), Some("c"));
        let create = &calls.all()[0];
        assert!(create.has_query("dryRun=All"), "{}", create.query);
        assert!(!create.has_query("force=true"), "{}", create.query);
        // Observed: the forced apply, as a dry run.
        let (writes, calls) = fake(server(Some(existing(Some("uid-w"), json!({})))));
        writes
            .dry_run_child(&configmaps(), &parent(), &child("c"), true)
            .await
            .unwrap();
        let apply = &calls.all()[0];
        assert!(apply.has_query("dryRun=All"), "{}", apply.query);
        assert!(apply.has_query("force=true"), "{}", apply.query);
        // A real apply never carries it.
        let (writes, calls) = fake(server(None));
        writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap();
        assert!(
            !calls.all()[0].has_query("dryRun"),
            "{}",
            calls.all()[0].query
        );
    }

    #[tokio::test]
    async fn an_absent_child_is_created_in_one_request_as_an_apply_would() {
        let (writes, calls) = fake(server(None));
        let outcome = writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap();
        assert_eq!(
            outcome,
            ChildOutcome::Applied {
                resource_version: Some("7".into())
            }
        );
        assert_eq!(calls.summary(), [format!("PATCH {CM}")]);
        let create = &calls.all()[0];
        assert!(
            create.has_query("fieldManager=capstan%2Fwidget"),
            "{}",
            create.query
        );
        assert!(!create.has_query("force=true"), "{}", create.query);
        let mut expected = child("c").manifest;
        expected["metadata"]["resourceVersion"] = json!(CREATE_ONLY);
        assert_eq!(
            create.body, expected,
            "the same fields as an apply, and the create-only precondition"
        );
    }

    #[tokio::test]
    async fn a_taken_name_is_adopted_if_it_consents_and_applied_if_controlled() {
        let consenting = existing(
            None,
            json!({"capstan.dev/allow-adoption-by": "widgets.test.capstan.dev/w"}),
        );
        let (writes, calls) = fake(server(Some(consenting)));
        let outcome = writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap();
        assert_eq!(outcome, ChildOutcome::Adopted);
        let all = calls.all();
        assert_eq!(
            calls.summary(),
            [
                format!("PATCH {CM}"),
                format!("GET {CM}"),
                format!("PATCH {CM}")
            ]
        );
        assert!(all[2].has_query("force=true") && !is_create_only(&all[2]));
        assert_eq!(all[2].body, child("c").manifest);

        let (writes, calls) = fake(server(Some(existing(Some("uid-w"), json!({})))));
        let outcome = writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap();
        assert!(matches!(outcome, ChildOutcome::Applied { .. }));
        let all = calls.all();
        assert_eq!(all.len(), 3, "{:?}", calls.summary());
        assert!(all[2].has_query("force=true") && !is_create_only(&all[2]));
    }

    #[tokio::test]
    async fn an_object_forged_with_this_parent_as_controller_is_a_conflict_never_written() {
        // Created by a user before the parent's first reconcile: its controller is the
        // parent, but no apply of Capstan's ever wrote it.
        let mut forged = existing(Some("uid-w"), json!({}));
        forged["metadata"]["managedFields"] =
            json!([{"manager": "kubectl-create", "operation": "Update"}]);
        let (writes, calls) = fake(server(Some(forged)));
        let outcome = writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap();
        match outcome {
            ChildOutcome::Conflict(conflict) => assert!(
                conflict
                    .to_string()
                    .contains("though Capstan never wrote it"),
                "{conflict}"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            calls.summary(),
            [format!("PATCH {CM}"), format!("GET {CM}")],
            "the create-only apply was refused, the read found the forgery, nothing else"
        );
    }

    #[tokio::test]
    async fn a_name_taken_then_freed_is_a_conflict_retried_soon() {
        let (writes, calls) = fake(|call: &Call| match call.method {
            Method::PATCH => fake_api::status(409, "Conflict", "the object has been modified"),
            _ => fake_api::status(404, "NotFound", "not found"),
        });
        let err = writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap_err();
        assert_eq!(err.class(), ErrorClass::Conflict, "{err}");
        assert_eq!(
            calls.summary(),
            [format!("PATCH {CM}"), format!("GET {CM}")]
        );
    }

    #[tokio::test]
    async fn an_observed_child_is_applied_without_a_read() {
        let (writes, calls) = fake(server(Some(existing(Some("uid-w"), json!({})))));
        writes
            .apply_child(&configmaps(), &parent(), &child("c"), true)
            .await
            .unwrap();
        assert_eq!(calls.summary(), [format!("PATCH {CM}")]);
        let apply = &calls.all()[0];
        assert!(apply.has_query("force=true") && !is_create_only(apply));
    }

    #[test]
    fn a_conflict_names_the_object_and_the_way_to_hand_it_over() {
        let c = OwnershipConflict {
            kind: "ConfigMap".into(),
            name: "precious".into(),
            controller: None,
            adoption: "widgets.test.capstan.dev/w".into(),
        };
        let text = c.to_string();
        assert!(
            text.contains("ConfigMap \"precious\" already exists"),
            "{text}"
        );
        assert!(
            text.contains("capstan.dev/allow-adoption-by=widgets.test.capstan.dev/w"),
            "{text}"
        );
        let owned = OwnershipConflict {
            controller: Some("Widget/other".into()),
            ..c
        };
        assert!(owned.to_string().contains("controlled by Widget/other"));
    }
}
