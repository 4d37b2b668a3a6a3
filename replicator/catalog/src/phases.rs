//! The `phases` column of replicas and transfers (migration 17): where a
//! replica's time to eval-ready went, as JSON
//! `{"before": {phase: seconds}, "after": {phase: seconds}}` (phase names
//! from [`Phase::as_str`]).

use std::time::Duration;

use ferry_proto::phases::{Phase, Phases};
use ferry_proto::state::TransferId;
use serde_json::{Map, Value};

use crate::{Catalog, CatalogError};

/// `p` as the column's JSON text.
pub fn encode(p: &Phases) -> String {
    let side = |m: &std::collections::BTreeMap<Phase, Duration>| {
        Value::Object(
            m.iter()
                .map(|(k, d)| (k.as_str().to_string(), Value::from(d.as_secs_f64())))
                .collect::<Map<_, _>>(),
        )
    };
    serde_json::json!({ "before": side(&p.before), "after": side(&p.after) }).to_string()
}

/// The column's JSON text read back.
///
/// # Errors
/// [`CatalogError::Corrupt`] naming what is not JSON, an unknown phase
/// or a duration that is not a finite number of seconds, 0 or more.
pub fn decode(s: &str) -> Result<Phases, CatalogError> {
    let bad = |why: String| CatalogError::Corrupt(format!("phases {s:?}: {why}"));
    let v: Value = serde_json::from_str(s).map_err(|e| bad(e.to_string()))?;
    let mut out = Phases::default();
    for (key, after) in [("before", false), ("after", true)] {
        let Some(side) = v.get(key) else { continue };
        let side = side
            .as_object()
            .ok_or_else(|| bad(format!("{key} is not an object")))?;
        for (name, secs) in side {
            let p = Phase::parse(name).ok_or_else(|| bad(format!("unknown phase {name:?}")))?;
            let d = secs
                .as_f64()
                .and_then(|x| Duration::try_from_secs_f64(x).ok())
                .ok_or_else(|| bad(format!("{name} is not a duration in seconds")))?;
            out.add(after, p, d);
        }
    }
    Ok(out)
}

/// Reads an optional `phases` column.
pub(crate) fn column(v: Option<String>) -> Result<Option<Phases>, sqlx::Error> {
    v.map(|s| {
        decode(&s).map_err(|e| sqlx::Error::ColumnDecode {
            index: "phases".into(),
            source: Box::new(e),
        })
    })
    .transpose()
}

impl Catalog {
    /// Records where a transfer's time went, once its replica is
    /// published (source side).
    ///
    /// # Errors
    /// [`CatalogError`] when the database fails.
    pub async fn set_transfer_phases(
        &self,
        id: TransferId,
        p: &Phases,
    ) -> Result<(), CatalogError> {
        sqlx::query(&self.db.sql("UPDATE transfers SET phases = ? WHERE id = ?"))
            .bind(encode(p))
            .bind(id.as_i64())
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_column_reads_back_and_bad_text_is_named() {
        let mut p = Phases::default();
        p.add(false, Phase::Announced, Duration::from_millis(2_500));
        p.add(true, Phase::Writer, Duration::ZERO);
        p.add(true, Phase::Sending, Duration::from_micros(1_234_567));
        let s = encode(&p);
        assert_eq!(decode(&s).expect("reads back"), p);
        for (text, says) in [
            ("nope", "expected"),
            (r#"{"after": {"lunch": 1}}"#, "unknown phase \"lunch\""),
            (r#"{"after": {"sending": -1}}"#, "sending is not a duration"),
            (r#"{"before": []}"#, "before is not an object"),
        ] {
            let e = decode(text).expect_err(text).to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
