//! Ferry's REST API.
