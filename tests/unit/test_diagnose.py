"""dtlab.course.diagnose: a rank's log in, the verdict's sentence out (pure, no ranks started)."""

from dtlab.course.diagnose import (
    failure_feedback,
    meaning,
    native_error,
    student_frame,
    where,
)

STUDENT = "# header\nimport torch\nimport torch.distributed as dist\n\n\ndef ring(t):\n    x = 1\n    dist.recv(t, 0)\n"


ABORT = """terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at /__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] \
op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size.
Fatal Python error: Aborted

Thread 0x00007f8f48c7eb80 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 2799 in recv
  File "/run/student.py", line 8 in ring
  File "/run/student.py", line 99 in outer
  File "/x/dtlab/course/harness.py", line 183 in _call_ring
"""


RAISED = """Traceback (most recent call last):
  File "/x/dtlab/course/harness.py", line 183 in _call_ring
  File "/run/student.py", line 99, in outer
  File "/run/student.py", line 7, in ring
    x = 1
RuntimeError: [/__w/gloo/pair.cc:537] Read error [127.0.0.1]:47506: Connection reset by peer.
"""


def test_the_innermost_student_frame_in_either_stack_format():
    assert student_frame(ABORT) == 8  # faulthandler: most recent call first
    assert student_frame(RAISED) == 7  # traceback: most recent call last
    assert student_frame("no frames here") is None


def test_native_error_drops_source_locations_and_prefers_the_abort_message():
    assert native_error(ABORT).startswith("op.preamble.length <= op.nbytes. 8 vs 4. Received data size")
    assert native_error(RAISED) == "RuntimeError: Read error [127.0.0.1]:47506: Connection reset by peer."
    assert native_error("") is None


def test_meaning_reads_the_sizes_of_a_mismatch():
    m = meaning(native_error(ABORT))
    assert "sent 8 B" in m and "at most 4 B" in m
    assert meaning("ValueError: something new") is None


def test_where_counts_lines_from_the_def_and_in_the_cell():
    assert (
        where(STUDENT, 8, def_line=6, cell_line=2, name="ring")
        == "line 3 of ring (line 4 of its cell): `dist.recv(t, 0)`"
    )
    assert where(STUDENT, 8, def_line=None, cell_line=None, name="ring") == "student.py line 8: `dist.recv(t, 0)`"


def test_the_peer_that_died_first_is_named_not_the_one_that_lost_its_connection():
    text = failure_feedback(
        "ring_allreduce",
        "failed",
        {0: RAISED, 1: ABORT},
        STUDENT,
        "ring",
        def_line=6,
        cell_line=2,
        culprit=0,
        signal=None,
    )
    assert text.startswith("ring_allreduce: rank 1 failed at line 3 of ring"), text
    assert "Received data size" in text and "Connection reset" not in text


def test_a_hang_names_where_every_rank_waits():
    text = failure_feedback(
        "ring_allreduce",
        "stalled",
        {0: ABORT, 1: ABORT},
        STUDENT,
        "ring",
        def_line=6,
        stall_s=5,
        hung_at=" checking n=3 elements",
    )
    assert "hung checking n=3 elements and were stopped after 5 s without progress" in text
    assert text.count("`dist.recv(t, 0)`") == 2
