"""Training a draft head for a graphrt target: EAGLE-3 distillation with the training-time test.

head.py the trainable head (published layout in and out), teacher.py the target's features through
transformers, data.py the target's own generations and the draft vocabulary, loop.py the loss and
optimiser, acceptance.py the teacher-forced acceptance estimate. scripts/train_eagle3.py drives them.
"""
