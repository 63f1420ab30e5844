"""`python -m kvcourse.grade`: the grader's command (the grader itself is kvcourse/course/grade.py)."""

import sys

from kvcourse.course.grade import main

if __name__ == "__main__":
    sys.exit(main())
