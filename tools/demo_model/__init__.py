"""How the embedded demo model (`portcullis/engine/assets/demo-model`) was made: its training
data (`demo_data`), its training run (`train_demo_model.py`, a script), its quality check
(`demo_eval`, with prompts fixed before training) and its card (`card`). Run from a checkout:

    python tools/demo_model/train_demo_model.py
"""
