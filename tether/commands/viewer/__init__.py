"""The trajectory viewer (``tether view runs/<id>``): the self-contained page (:mod:`.page`, its script in
:mod:`.page_script`, token ids to text in :mod:`.tokens`) that shows what the learner keeps of the groups it
trained on and of the dead letters, and the timeline of ``tether trace`` (:mod:`.timeline`). The files
themselves are written and read through the core's :mod:`tether.records` (standard library only), so the
learner writes them without importing the viewer.
"""
