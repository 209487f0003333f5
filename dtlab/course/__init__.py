"""The course tooling's room: what the labs use to check students' work, and how it is graded.

- `checks` (formative, in the notebook) and `verdicts` (pure): a question's key and a verdict on an answer that
  never shows it;
- `claims` (a package: the machinery, and one module per lab that prints claims): statements about outcomes, each
  with the outcome its own measurement gives (holds, inconclusive, contradicted);
- `outputs`: the records checks and claims leave in a cell's output, and the one reader of them;
- `rubric` (one module per lab): each graded question, its points and how its key is computed from the lab's
  recordings;
- `grader` (one notebook, in a process of its own), `integrity` (recordings' consistency, check-cell fingerprints),
  `recordings`, `batch` (`dtlab grade`), `assign` (`dtlab assign`), `autograde` (the otter hidden tests), `replay`
  (grading from recorded runs): see docs/course.md;
- `exercises` (notebook side) and `harness` (rank side, started by torchrun): the "build it yourself" checks of
  lab 08, which run the student's comm hook and ring all-reduce on 2 gloo ranks against references.
"""
