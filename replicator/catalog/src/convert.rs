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

/// A nullable `REAL` / `DOUBLE PRECISION` value to bind: `.bind(real(v))`
/// instead of `.bind(v)` for an `Option<f64>`.
///
/// sqlx 0.8's `Any` driver hands PostgreSQL a `NULL` bound as
/// `Option::<f64>::None` as a `float4` parameter (its table of typed NULLs
/// swaps `REAL` and `DOUBLE`), and a `Some(f64)` as `float8`. PostgreSQL
/// connections cache each statement with the parameter types of its first
/// run, so a statement first run with `NULL` then fails with "incorrect
/// binary data format" for the next non-`NULL` value. This binds `NULL`
/// through the other entry of that table, so both are `float8`; the
/// conformance suite on PostgreSQL (`Catalog` tests with a `NULL` and then
/// a value in one column) fails if a later sqlx changes the mapping.
pub(crate) fn real(v: Option<f64>) -> NullableReal {
    NullableReal(v)
}

/// See [`real`].
pub(crate) struct NullableReal(Option<f64>);

impl sqlx::Type<sqlx::Any> for NullableReal {
    fn type_info() -> sqlx::any::AnyTypeInfo {
        <f64 as sqlx::Type<sqlx::Any>>::type_info()
    }
}

impl<'q> sqlx::Encode<'q, sqlx::Any> for NullableReal {
    fn encode_by_ref(
        &self,
        buf: &mut <sqlx::Any as sqlx::Database>::ArgumentBuffer<'q>,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        match self.0 {
            Some(v) => <f64 as sqlx::Encode<'q, sqlx::Any>>::encode_by_ref(&v, buf),
            None => <Option<f32> as sqlx::Encode<'q, sqlx::Any>>::encode_by_ref(&None, buf),
        }
    }
}
