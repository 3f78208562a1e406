// chart.js - a small live line chart: an SVG polyline per series over the
// last N samples, the y axis from 0 to the largest value shown, the latest
// values in text beside the title (what a screen reader reads).
const SVG = "http://www.w3.org/2000/svg";
const W = 300, H = 100;

export class Chart {
  // title; series: [{name, unit}]; keep: samples kept.
  constructor(parent, id, title, series, keep = 60) {
    this.series = series;
    this.keep = keep;
    this.data = series.map(() => []);
    this.fig = document.createElement("figure");
    this.fig.className = "chart";
    this.fig.id = id;
    const cap = document.createElement("figcaption");
    const h = document.createElement("h3");
    h.textContent = title;
    this.values = document.createElement("p");
    this.values.className = "values";
    this.values.setAttribute("aria-live", "off");
    cap.append(h, this.values);
    this.svg = document.createElementNS(SVG, "svg");
    this.svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    this.svg.setAttribute("preserveAspectRatio", "none");
    this.svg.setAttribute("aria-hidden", "true");
    this.lines = series.map((s, i) => {
      const p = document.createElementNS(SVG, "polyline");
      p.setAttribute("class", "series s" + i);
      this.svg.appendChild(p);
      return p;
    });
    this.max = document.createElement("span");
    this.max.className = "ymax";
    this.fig.append(cap, this.svg, this.max);
    parent.appendChild(this.fig);
  }

  // One sample: a value per series (null leaves a gap).
  push(values) {
    values.forEach((v, i) => {
      const d = this.data[i];
      d.push(v);
      if (d.length > this.keep) d.shift();
    });
    this.render();
  }

  render() {
    let top = 0;
    for (const d of this.data) for (const v of d) if (v !== null && v > top) top = v;
    const scale = top > 0 ? top * 1.1 : 1;
    this.data.forEach((d, i) => {
      const pts = [];
      const skip = this.keep - d.length; // the newest sample at the right edge
      d.forEach((v, j) => {
        if (v === null) return;
        const x = ((skip + j) / Math.max(1, this.keep - 1)) * W;
        pts.push(x.toFixed(1) + "," + (H - (v / scale) * H).toFixed(1));
      });
      this.lines[i].setAttribute("points", pts.join(" "));
    });
    this.max.textContent = "max " + fmt(top);
    const last = this.data.map((d) => d[d.length - 1]);
    this.values.textContent = "";
    this.series.forEach((s, i) => {
      const span = document.createElement("span");
      span.className = "key s" + i; // the line's colour, as a swatch before the name
      span.textContent = s.name + " " + (last[i] === null || last[i] === undefined ? "–" : fmt(last[i]) + (s.unit || ""));
      this.values.append(span, " ");
    });
    this.fig.dataset.samples = String(this.data[0].length);
    this.fig.dataset.last = JSON.stringify(last);
  }
}

function fmt(v) {
  if (v === 0) return "0";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 10) return v.toFixed(1);
  return v.toPrecision(2);
}
