//! Typed values at the catalog's boundary: enums stored as their names,
//! transfer ids as `BIGINT`, the profile as `NULL` for every file.

use std::str::FromStr;

use ferry_proto::state::{Profile, TransferId};
use sqlx::any::AnyRow;
use sqlx::Row;

/// A column holding one of a typed enum's names (`as_str`), parsed back.
pub(crate) fn parsed<T>(r: &AnyRow, col: &'static str) -> Result<T, sqlx::Error>
where
    T: FromStr,
    T::Err: std::error::Error + Send + Sync + 'static,
{
    let text: String = r.try_get(col)?;
    text.parse().map_err(|e| sqlx::Error::ColumnDecode {
        index: col.into(),
        source: Box::new(e),
    })
}

/// A transfer id column (`BIGINT`, never negative).
pub(crate) fn transfer_id(r: &AnyRow, col: &'static str) -> Result<TransferId, sqlx::Error> {
    let v: i64 = r.try_get(col)?;
    TransferId::from_i64(v).ok_or_else(|| sqlx::Error::ColumnDecode {
        index: col.into(),
        source: format!("negative transfer id {v}").into(),
    })
}

/// A nullable transfer id column.
pub(crate) fn transfer_id_opt(
    r: &AnyRow,
    col: &'static str,
) -> Result<Option<TransferId>, sqlx::Error> {
    let v: Option<i64> = r.try_get(col)?;
    v.map(|_| transfer_id(r, col)).transpose()
}

/// The `profile` column: `NULL` for every file, else the profile's name.
pub(crate) fn profile(r: &AnyRow) -> Result<Profile, sqlx::Error> {
    let name: Option<String> = r.try_get("profile")?;
    Profile::from_stored(name.as_deref()).map_err(|e| sqlx::Error::ColumnDecode {
        index: "profile".into(),
        source: Box::new(e),
    })
}
