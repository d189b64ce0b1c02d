"""The trajectory viewer (``tether view runs/<id>``): what the learner keeps of the groups it trained on and
of the dead letters (:mod:`tether.viewer.records`), and the self-contained page that shows them
(:mod:`tether.viewer.page`, its script in :mod:`tether.viewer.page_script`, token ids to text in
:mod:`tether.viewer.tokens`). The files' module is standard library only, so the learner writes them and the
viewer reads them without either importing the other.
"""
