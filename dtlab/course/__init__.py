"""The course tooling's room: what the labs use to check students' work.

- `checks` (pure, no torch): checked predictions; each answer is recorded in the notebook's outputs and read back
  by a grader with `parse_answers`.
- `exercises` (notebook side) and `harness` (rank side, started by torchrun): the "build it yourself" checks of
  lab 08, which run the student's comm hook and ring all-reduce on 2 gloo ranks against references.
"""
