"""What only the notebooks use: the memory model (:mod:`~attnlab.lessons.memory`), precision experiments
(:mod:`~attnlab.lessons.precision`), online-softmax traces (:mod:`~attnlab.lessons.online_softmax`), the CUDA
kernels' sources and thread maps (:mod:`~attnlab.lessons.kernel_notes`), common mistakes
(:mod:`~attnlab.lessons.mistakes`), the backward and a tiny training run (:mod:`~attnlab.lessons.gradients`,
:mod:`~attnlab.lessons.training`), decode (:mod:`~attnlab.lessons.decoding`), the features models ship with
(:mod:`~attnlab.lessons.model_features`), the Triton guide's choices (:mod:`~attnlab.lessons.guide_quirks`)
and the figures (:mod:`~attnlab.lessons.figures`)."""
