//! Ferry's scheduler: pure logic, no I/O, clock passed in.
