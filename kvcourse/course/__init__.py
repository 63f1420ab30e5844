"""The course machinery: exercise registry, grading, feedback, stubs, the solutions switch, env check.

Nothing here is part of the engine a learner builds; a lesson module imports none of it except
`solutions_switch` (the tiny import hook behind KVCOURSE_SOLUTIONS=1).
"""
