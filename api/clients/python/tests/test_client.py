"""The Python client against real agents.

Run by the Rust test ``tests/python_client.rs`` (part of the test command in
README.md), which starts a source and a sink agent, writes a checkpoint
under the source root and sets:

- ``FERRY_PY_SOURCE`` / ``FERRY_PY_SINK``: the agents' API URLs;
- ``FERRY_PY_READER`` / ``FERRY_PY_OPERATOR``: tokens of those roles;
- ``FERRY_PY_JOB``, ``FERRY_PY_ROOT``: the job and its source root, under
  which ``step_000100`` is written and ``step_000200`` is not.
"""

import os
import pathlib
import time
import unittest

from ferry_client import Client, FerryError


def env(name: str) -> str:
    v = os.environ.get(name)
    if not v:
        raise RuntimeError(
            f"{name} is not set: these tests run from `cargo test --test python_client` "
            "(the test command in README.md), which starts the agents"
        )
    return v


class AgainstAgents(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.source = Client(env("FERRY_PY_SOURCE"), token=env("FERRY_PY_OPERATOR"))
        cls.sink = Client(env("FERRY_PY_SINK"), token=env("FERRY_PY_READER"))
        cls.job = env("FERRY_PY_JOB")
        cls.root = pathlib.Path(env("FERRY_PY_ROOT"))
        cls.ckpt = str(cls.root / "step_000100")

    def test_1_push_with_a_deadline_is_answered_and_resolves_local(self) -> None:
        t = self.source.push(self.ckpt, deadline="1h")
        a = Client.admission_of(t)
        self.assertIsNotNone(a)
        assert a is not None
        self.assertTrue(a.feasible, a)
        self.assertGreater(a.deadline_ms, a.eta_ms)
        r = self.sink.resolve(self.ckpt, wait="120s")
        self.assertEqual(r.state, "local", r.raw)
        assert r.location is not None
        self.assertTrue(pathlib.Path(r.location).is_dir(), r.raw)
        # A pushed directory is published whole: the full replica.
        full = self.sink.resolve(self.ckpt, full=True)
        self.assertEqual((full.state, full.profile), ("local", None), full.raw)
        self.assertEqual(full.replica, r.replica)

    def test_2_a_lease_holds_its_version_and_is_released(self) -> None:
        self.sink.resolve(self.ckpt, wait="120s")
        with self.sink.lease(self.ckpt, duration="3s") as r:
            assert r.lease is not None and r.location is not None
            lease_id = r.lease.id
            # Held past its first length: the client renews it.
            time.sleep(4.5)
            self.assertTrue(pathlib.Path(r.location).is_dir())
            renewed = self.sink.renew_lease(lease_id)
            self.assertEqual(renewed["id"], lease_id)
        with self.assertRaises(FerryError) as e:
            self.sink.renew_lease(lease_id)
        self.assertEqual(e.exception.status, 410, e.exception)

    def test_3_outlook_signal_and_announce(self) -> None:
        o = self.source.outlook(self.job)
        self.assertGreater(o.checkpoint_bytes, 0, o)
        self.assertIsNotNone(o.next_ready_ms, o)
        with self.assertRaises(FerryError) as e:
            self.source.outlook("no-such-job")
        self.assertEqual(e.exception.status, 404)
        s = self.source.signal(self.job, severity=0.5, step=100)
        self.assertIn("signal", s)
        a = self.source.announce(
            self.job,
            200,
            str(self.root / "step_000200"),
            expected_bytes=10_000_000,
            deadline="10m",
            readers=4096,
        )
        self.assertTrue(a["selected"], a)
        self.assertEqual(a["transfer"]["readers"], 4096, a)
        with self.assertRaises(FerryError) as e:
            self.source.announce(self.job, 300, str(self.root / "step_000300"), readers=0)
        self.assertEqual(e.exception.status, 422)
        self.assertIn("readers", e.exception.message)
        self.assertIn("outlook", a)
        self.assertEqual(a["outlook"]["checkpoint_bytes"], 10_000_000, a)
        t = a["transfer"]
        self.assertEqual(t["deadline_after_commit_s"], 600.0, t)
        adm = Client.admission_of(t)
        assert adm is not None
        self.assertTrue(adm.feasible, adm)

    def test_4_publish_events_replay_from_the_log(self) -> None:
        self.sink.resolve(self.ckpt, wait="120s")
        seen = []
        for ev in self.sink.replica_events(job=self.job, since=0, idle_timeout=3.0):
            seen.append(ev)
            if ev.kind == "published":
                break
        kinds = [e.kind for e in seen]
        self.assertIn("published", kinds, seen)
        first = seen[kinds.index("published")]
        self.assertGreater(first.id, 0)
        # Resuming after that id does not replay it.
        after = list(self.sink.replica_events(job=self.job, since=first.id, reconnect=False, idle_timeout=2.0))
        self.assertNotIn(first.id, [e.id for e in after])

    def test_5_errors_name_the_problem(self) -> None:
        bad = Client(env("FERRY_PY_SINK"), token="not-a-token")
        with self.assertRaises(FerryError) as e:
            bad.resolve(self.ckpt)
        self.assertEqual(e.exception.status, 401)
        nowhere = Client("http://127.0.0.1:9", timeout=2)
        with self.assertRaises(FerryError) as e:
            nowhere.outlook(self.job)
        self.assertEqual(e.exception.status, 0)


if __name__ == "__main__":
    unittest.main()
