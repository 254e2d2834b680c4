"""Everything that touches llama.cpp: library choice, ABI check, model, context, sampler.

Nothing outside native/ calls ``llama_cpp`` directly; gui/ never imports native/.
"""
