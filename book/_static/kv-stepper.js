// Step through a block-table widget's recorded run on the website: one frame per step, stored with the
// notebook (scripts/execute_notebooks.py: a JSON list, zlib-compressed, base64) and put in the page by
// scripts/build_site.py. No kernel needed: the browser inflates the frames and swaps them in.
(function () {
  "use strict";
  async function inflate(base64) {
    const bytes = Uint8Array.from(atob(base64.trim()), (c) => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return JSON.parse(await new Response(stream).text());
  }
  async function setUp(stepper) {
    const frames = await inflate(stepper.querySelector(":scope > .kv-stepper-frames").textContent);
    const view = stepper.querySelector(":scope > .kv-stepper-frame");
    const slider = stepper.querySelector(".kv-stepper-slider");
    const readout = stepper.querySelector(".kv-stepper-readout");
    const play = stepper.querySelector(".kv-stepper-play");
    let timer = null;
    const current = () => Number(stepper.dataset.step);
    function show(step) {
      const next = Math.max(0, Math.min(frames.length - 1, step));
      view.innerHTML = frames[next];
      stepper.dataset.step = String(next);
      slider.value = String(next);
      readout.textContent = String(next);
      return next;
    }
    function stop() {
      if (timer !== null) { clearInterval(timer); timer = null; play.textContent = "▶ play"; }
    }
    stepper.querySelector(".kv-stepper-back").addEventListener("click", () => { stop(); show(current() - 1); });
    stepper.querySelector(".kv-stepper-forward").addEventListener("click", () => { stop(); show(current() + 1); });
    slider.addEventListener("input", () => { stop(); show(Number(slider.value)); });
    play.addEventListener("click", () => {
      if (timer !== null) { stop(); return; }
      if (current() >= frames.length - 1) show(0);
      play.textContent = "❚❚ pause";
      timer = setInterval(() => { if (show(current() + 1) >= frames.length - 1) stop(); }, 700);
    });
    stepper.querySelectorAll("button, input").forEach((control) => { control.disabled = frames.length < 2; });
    stepper.classList.add("kv-stepper-ready");
  }
  function setUpAll() {
    document.querySelectorAll(".kv-stepper").forEach((stepper) => {
      setUp(stepper).catch((error) => {
        stepper.classList.add("kv-stepper-failed");
        console.error("kvcourse: could not load the widget's recorded steps:", error);
      });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setUpAll);
  else setUpAll();
})();
