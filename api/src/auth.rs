//! Bearer tokens with roles.
//!
//! A client sends `Authorization: Bearer <token>`. The agent's config holds
//! only each token's BLAKE3 hash (`blake3:<64 hex digits>`), its role and a
//! name for logs; `ferry token new --role R` makes a token and prints the
//! line to paste. Tokens are 256 random bits, so a fast hash is enough: the
//! hash cannot be reversed and a guess cannot succeed.
//!
//! Roles are ordered, each allowing what the ones before it allow:
//! - `reader`: resolve paths, list replicas, transfers, jobs, links and
//!   signals, the UI's live view, `/metrics`;
//! - `signaler`: also send signals and announce checkpoints (training
//!   controllers);
//! - `operator`: also queue transfers, pause, resume, cancel, change class
//!   or importance, set jobs and change a link's rate cap.
//!
//! No token or an unknown one is 401; a known token whose role is too low
//! is 403. Tokens are never logged: only the token's configured name is.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, Request, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rand::RngCore;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// What a token may do; ordered `Reader < Signaler < Operator`.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Resolve and list.
    Reader,
    /// Also signals and announcements.
    Signaler,
    /// Also transfers, actions and rate caps.
    Operator,
}

impl Role {
    /// Every role, lowest first.
    pub const ALL: [Role; 3] = [Role::Reader, Role::Signaler, Role::Operator];

    /// The role's name in config, API and OpenAPI (`reader`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Signaler => "signaler",
            Role::Operator => "operator",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown role {s:?} (expected reader, signaler or operator)"))
    }
}

/// Prefix of every token `ferry token new` makes.
pub const TOKEN_PREFIX: &str = "ferry_";

/// Prefix of a token hash in the config.
pub const HASH_PREFIX: &str = "blake3:";

/// A new random token: `ferry_` and 64 hex digits (256 bits from the OS
/// generator).
pub fn new_token() -> String {
    let mut b = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut b);
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{TOKEN_PREFIX}{hex}")
}

/// The config form of `token`'s hash: `blake3:<64 hex digits>`.
pub fn hash_token(token: &str) -> String {
    format!("{HASH_PREFIX}{}", blake3::hash(token.as_bytes()).to_hex())
}

/// Parses a config hash `blake3:<64 hex digits>`.
///
/// # Errors
/// A message saying what the expected form is.
pub fn parse_hash(s: &str) -> Result<blake3::Hash, String> {
    if s.starts_with(TOKEN_PREFIX) {
        // Never echo what may be a secret.
        return Err(
            "this is a token, not its hash: the config holds only hashes \
                    (`ferry token new` prints both)"
                .into(),
        );
    }
    let shown: String = s.chars().take(16).collect();
    let hex = s.strip_prefix(HASH_PREFIX).ok_or_else(|| {
        format!("token hash must look like \"blake3:<64 hex digits>\" (ferry token new prints one), got {shown:?}...")
    })?;
    blake3::Hash::from_hex(hex).map_err(|e| {
        format!("token hash {shown:?}...: {e} (expected 64 hex digits after \"blake3:\")")
    })
}

/// One accepted token, as configured.
#[derive(Debug, Clone)]
pub struct TokenEntry {
    /// Name shown in logs instead of the token (e.g. `eval-cluster-b`).
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// BLAKE3 hash of the token.
    pub hash: blake3::Hash,
}

/// The API's access rule; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    tokens: Arc<Vec<TokenEntry>>,
    open: bool,
}

/// Who made a request, once authenticated (a request extension).
#[derive(Debug, Clone)]
pub struct Caller {
    /// The token's name, or `anonymous` when the API is open.
    pub name: String,
    /// Its role.
    pub role: Role,
}

impl Auth {
    /// Only requests with one of `tokens` are served.
    pub fn tokens(tokens: Vec<TokenEntry>) -> Auth {
        Auth {
            tokens: Arc::new(tokens),
            open: false,
        }
    }

    /// Requests without a token get every role (a local demo only; the
    /// config switch is `[api] allow_unauthenticated`). A token that is
    /// sent is still checked.
    pub fn open(tokens: Vec<TokenEntry>) -> Auth {
        Auth {
            tokens: Arc::new(tokens),
            open: true,
        }
    }

    /// True if requests without a token are served.
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Who sent `authorization` (the header's value, if any).
    ///
    /// # Errors
    /// 401 for a missing, malformed or unknown token (and the API is not
    /// open).
    pub fn authenticate(&self, authorization: Option<&HeaderValue>) -> Result<Caller, ApiError> {
        let Some(v) = authorization else {
            if self.open {
                return Ok(Caller {
                    name: "anonymous".into(),
                    role: Role::Operator,
                });
            }
            return Err(unauthorized(
                "missing bearer token: send `Authorization: Bearer <token>` \
                 (an operator makes one with `ferry token new --role reader`)",
            ));
        };
        let token = v
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, rest) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            })
            .filter(|t| !t.is_empty())
            .ok_or_else(|| unauthorized("the Authorization header must be `Bearer <token>`"))?;
        let h = blake3::hash(token.as_bytes());
        // blake3::Hash's equality is constant-time.
        self.tokens
            .iter()
            .find(|e| e.hash == h)
            .map(|e| Caller {
                name: e.name.clone(),
                role: e.role,
            })
            .ok_or_else(|| unauthorized("unknown or revoked token"))
    }
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, message)
}

/// Middleware state: the access rule and the role a route group needs.
#[derive(Debug, Clone)]
pub(crate) struct Guard {
    pub(crate) auth: Auth,
    pub(crate) role: Role,
}

/// Middleware: 401 unless the request is authenticated, 403 unless its
/// role is at least the route's.
pub(crate) async fn require(
    State(g): State<Guard>,
    mut req: Request<Body>,
    next: Next,
) -> Response {
    let caller = match g
        .auth
        .authenticate(req.headers().get(header::AUTHORIZATION))
    {
        Ok(c) => c,
        Err(e) => {
            let mut r = e.into_response();
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"ferry\""),
            );
            return r;
        }
    };
    if caller.role < g.role {
        let allowed: Vec<&str> = Role::ALL
            .into_iter()
            .filter(|r| *r >= g.role)
            .map(Role::as_str)
            .collect();
        return ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "token {:?} has role {}; {} {} needs {}",
                caller.name,
                caller.role,
                req.method(),
                req.uri().path(),
                allowed.join(" or ")
            ),
        )
        .into_response();
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn tokens_are_random_and_their_hashes_parse_back() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX) && a.len() == TOKEN_PREFIX.len() + 64);
        let h = hash_token(&a);
        assert_eq!(parse_hash(&h).unwrap(), blake3::hash(a.as_bytes()));
        assert!(
            !h.contains(&a[TOKEN_PREFIX.len()..]),
            "the hash shows the token"
        );
        for bad in ["", "blake3:", "sha256:00", "blake3:zz"] {
            let e = parse_hash(bad).unwrap_err();
            assert!(e.contains("blake3:"), "{e}");
        }
        let e = parse_hash(&a).unwrap_err();
        assert!(
            e.contains("not its hash") && !e.contains(&a[TOKEN_PREFIX.len()..]),
            "{e}"
        );
    }

    #[test]
    fn roles_parse_and_order() {
        assert_eq!("signaler".parse::<Role>().unwrap(), Role::Signaler);
        assert!("admin".parse::<Role>().unwrap_err().contains("admin"));
        assert!(Role::Reader < Role::Signaler && Role::Signaler < Role::Operator);
    }

    #[test]
    fn authenticate_tells_missing_malformed_and_unknown_apart() {
        let t = new_token();
        let auth = Auth::tokens(vec![TokenEntry {
            name: "ops".into(),
            role: Role::Operator,
            hash: blake3::hash(t.as_bytes()),
        }]);
        let hv = |s: &str| HeaderValue::from_str(s).unwrap();
        let c = auth
            .authenticate(Some(&hv(&format!("Bearer {t}"))))
            .unwrap();
        assert_eq!((c.name.as_str(), c.role), ("ops", Role::Operator));
        let c = auth
            .authenticate(Some(&hv(&format!("bearer  {t}"))))
            .unwrap();
        assert_eq!(c.role, Role::Operator);
        for (h, want) in [
            (None, "missing"),
            (Some(hv(&t)), "Bearer <token>"),
            (Some(hv("Bearer ")), "Bearer <token>"),
            (Some(hv("Basic abc")), "Bearer <token>"),
            (Some(hv(&format!("Bearer {t}x"))), "unknown"),
        ] {
            let e = auth.authenticate(h.as_ref()).unwrap_err();
            assert_eq!(e.status, StatusCode::UNAUTHORIZED);
            assert!(e.message.contains(want), "{}", e.message);
            assert!(!e.message.contains(&t), "a token was echoed");
        }
        // Open: no token is an operator, a wrong one is still refused.
        let open = Auth::open(vec![]);
        assert_eq!(open.authenticate(None).unwrap().role, Role::Operator);
        let e = open.authenticate(Some(&hv("Bearer nope"))).unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
    }
}
