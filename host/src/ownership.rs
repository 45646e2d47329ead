//! Who may write an existing object: the ownership rules the host applies before it
//! writes, prunes or adopts anything on a plugin's word.
//!
//! A plugin only *names* the children it wants. Whether the host may write an object of
//! that name is decided here, from the object as it is in the cluster: the host writes
//! to an object only when this parent is its controller, or when the object itself
//! consents to be adopted by this parent (an annotation its owner put there). Anything
//! else is a conflict: nothing is written, and the parent says why. Without this rule a
//! plugin could take over, and through garbage collection delete, any object in the
//! namespace (a confused deputy).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::contract::KindRef;
use crate::plan::HOST_FIELD_MANAGER;

/// Whether Capstan wrote `meta`'s object: a server-side apply of the host's (field
/// manager `capstan`) or of one of its plugins (`capstan/<plugin>`) owns some of its
/// fields. An owner reference alone proves nothing: anyone who may create an object
/// may write one naming any parent, before the parent's first reconcile (a Secret
/// whose password the plugin would then take for its own). Every child the host
/// creates or adopts is written by such an apply.
pub fn written_by_capstan(meta: &ObjectMeta) -> bool {
    meta.managed_fields.iter().flatten().any(|entry| {
        entry.operation.as_deref() == Some("Apply")
            && entry.manager.as_deref().is_some_and(|manager| {
                manager == HOST_FIELD_MANAGER
                    || manager
                        .strip_prefix(HOST_FIELD_MANAGER)
                        .is_some_and(|rest| rest.starts_with('/'))
            })
    })
}

/// Annotation by which an object that no controller owns consents to be adopted by one
/// parent: its value is `<plural>.<group>/<name>` of that parent (`<plural>/<name>` for
/// the core group), e.g. `widgets.test.capstan.dev/my-widget`. The parent must be in the
/// object's namespace.
pub const ADOPT_ANNOTATION: &str = "capstan.dev/allow-adoption-by";

/// What the host may do with an existing object that a parent wants as a child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ownership {
    /// This parent is its controller, and Capstan wrote it ([`written_by_capstan`]): the
    /// host may write and prune it.
    Controlled,
    /// No controller, and the object names this parent in [`ADOPT_ANNOTATION`]: the host
    /// may take it over (it becomes [`Ownership::Controlled`]).
    Adoptable,
    /// Anything else: the host must not touch it.
    Foreign {
        /// The object's controller (`Kind/name`), if it has one.
        controller: Option<String>,
    },
}

/// The value of [`ADOPT_ANNOTATION`] that names the parent `name` of kind `parent`.
pub fn adoption_ref(parent: &KindRef, name: &str) -> String {
    if parent.group.is_empty() {
        format!("{}/{name}", parent.plural)
    } else {
        format!("{}.{}/{name}", parent.plural, parent.group)
    }
}

/// Decides what the host may do with `existing`, wanted by the parent whose UID is
/// `parent_uid` and whose [`adoption_ref`] is `adoption`.
pub fn ownership(existing: &ObjectMeta, parent_uid: &str, adoption: &str) -> Ownership {
    let controller = existing
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true));
    match controller {
        Some(c) if c.uid == parent_uid && written_by_capstan(existing) => Ownership::Controlled,
        Some(c) if c.uid == parent_uid => Ownership::Foreign {
            controller: Some(format!(
                "{}/{} in its ownerReferences, though Capstan never wrote it",
                c.kind, c.name
            )),
        },
        Some(c) => Ownership::Foreign {
            controller: Some(format!("{}/{}", c.kind, c.name)),
        },
        None => {
            let consents = existing
                .annotations
                .as_ref()
                .and_then(|a| a.get(ADOPT_ANNOTATION))
                .is_some_and(|v| v.trim() == adoption);
            if consents {
                Ownership::Adoptable
            } else {
                Ownership::Foreign { controller: None }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, OwnerReference};

    fn widget() -> KindRef {
        KindRef {
            group: "test.capstan.dev".into(),
            version: "v1".into(),
            kind: "Widget".into(),
            plural: "widgets".into(),
            namespaced: true,
        }
    }

    fn owner(uid: &str, controller: Option<bool>) -> OwnerReference {
        OwnerReference {
            api_version: "test.capstan.dev/v1".into(),
            kind: "Widget".into(),
            name: "other".into(),
            uid: uid.into(),
            controller,
            block_owner_deletion: None,
        }
    }

    fn meta(owners: Vec<OwnerReference>, adopt: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            name: Some("precious".into()),
            owner_references: (!owners.is_empty()).then_some(owners),
            annotations: adopt.map(|v| [(ADOPT_ANNOTATION.to_string(), v.to_string())].into()),
            managed_fields: Some(vec![managed("capstan/widget", "Apply")]),
            ..ObjectMeta::default()
        }
    }

    fn managed(manager: &str, operation: &str) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.into()),
            operation: Some(operation.into()),
            ..ManagedFieldsEntry::default()
        }
    }

    #[test]
    fn an_owner_reference_to_this_parent_that_capstan_never_wrote_is_forged() {
        // A user who may create Secrets writes one naming the parent as its controller.
        for managers in [
            vec![],
            vec![managed("kubectl-create", "Update")],
            vec![managed("kubectl", "Apply")],
            vec![managed("capstanx/widget", "Apply")],
            vec![managed("capstan/widget", "Update")],
        ] {
            let mut m = meta(vec![owner("u-1", Some(true))], None);
            m.managed_fields = Some(managers.clone());
            assert!(!written_by_capstan(&m), "{managers:?}");
            match ownership(&m, "u-1", "widgets.test.capstan.dev/w") {
                Ownership::Foreign {
                    controller: Some(c),
                } => {
                    assert!(c.contains("though Capstan never wrote it"), "{c}")
                }
                other => panic!("{managers:?}: {other:?}"),
            }
        }
        // The host's own applies: a plugin's field manager, or the host's (older hosts).
        for manager in ["capstan/widget", "capstan"] {
            let mut m = meta(vec![owner("u-1", Some(true))], None);
            m.managed_fields = Some(vec![
                managed("kubectl-edit", "Update"),
                managed(manager, "Apply"),
            ]);
            assert_eq!(
                ownership(&m, "u-1", "widgets.test.capstan.dev/w"),
                Ownership::Controlled
            );
        }
    }

    #[test]
    fn adoption_ref_names_the_parent_like_kubectl() {
        assert_eq!(adoption_ref(&widget(), "w"), "widgets.test.capstan.dev/w");
        let core = KindRef {
            group: String::new(),
            plural: "configmaps".into(),
            ..widget()
        };
        assert_eq!(adoption_ref(&core, "c"), "configmaps/c");
    }

    #[test]
    fn an_object_this_parent_controls_is_ours() {
        let m = meta(vec![owner("u-1", Some(true))], None);
        assert_eq!(
            ownership(&m, "u-1", "widgets.test.capstan.dev/w"),
            Ownership::Controlled
        );
    }

    #[test]
    fn a_user_object_without_consent_is_foreign() {
        let m = meta(vec![], None);
        assert_eq!(
            ownership(&m, "u-1", "widgets.test.capstan.dev/w"),
            Ownership::Foreign { controller: None }
        );
        // A non-controller owner reference to this parent is not control either.
        let m = meta(vec![owner("u-1", None)], None);
        assert_eq!(
            ownership(&m, "u-1", "widgets.test.capstan.dev/w"),
            Ownership::Foreign { controller: None }
        );
    }

    #[test]
    fn an_object_with_another_controller_is_foreign_even_if_it_consents() {
        let m = meta(
            vec![owner("u-2", Some(true))],
            Some("widgets.test.capstan.dev/w"),
        );
        assert_eq!(
            ownership(&m, "u-1", "widgets.test.capstan.dev/w"),
            Ownership::Foreign {
                controller: Some("Widget/other".into())
            }
        );
    }

    #[test]
    fn consent_must_name_exactly_this_parent() {
        let m = meta(vec![], Some("widgets.test.capstan.dev/w"));
        assert_eq!(
            ownership(&m, "u-1", "widgets.test.capstan.dev/w"),
            Ownership::Adoptable
        );
        assert!(matches!(
            ownership(&m, "u-1", "widgets.test.capstan.dev/other"),
            Ownership::Foreign { .. }
        ));
        assert!(matches!(
            ownership(&m, "u-1", "gadgets.test.capstan.dev/w"),
            Ownership::Foreign { .. }
        ));
    }
}
