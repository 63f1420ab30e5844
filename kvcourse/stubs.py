"""`python -m kvcourse.stubs`: regenerate the learner's stubs (the generator is kvcourse/course/stubs.py)."""

import sys

from kvcourse.course.stubs import main

if __name__ == "__main__":
    sys.exit(main())
